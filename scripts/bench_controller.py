"""Benchmark: what the GNMR controller costs, measured side by side in one run.

1. `GNMRPolicy.step` time for 320 (LLaMA-2 70B), 3,200 and 31,000 (DeepSeek-V3-like MoE)
   units, on random norms with spikes (and once with NaN norms, which put units' Delta-GNMR
   windows out of phase with each other).
2. Training step time with `--gnmr` off vs on, for the tiny CPU model and a larger CPU model
   (8 layers, hidden 512). Off is megatron's own optimizer step (its clipping computes the
   global norm); on replaces that norm pass by the per-unit statistics and adds the policy.
   Steps alternate between the two trainers so machine drift hits both alike.

    .venv/bin/python scripts/bench_controller.py [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def bench_policy(num_units: int, steps: int, nonfinite: float = 0.0) -> float:
    from megatron_gnmr.controller import GNMRConfig, GNMRPolicy

    rng = np.random.default_rng(0)
    policy = GNMRPolicy(GNMRConfig(max_o=0.01), num_units)
    rows = rng.lognormal(size=(steps, num_units))
    rows[rng.random(rows.shape) < 0.001] *= 50  # spikes
    rows[rng.random(rows.shape) < nonfinite] = np.nan  # puts units' windows out of phase
    times = []
    for row in rows:
        start = time.perf_counter()
        policy.step(row)
        times.append(time.perf_counter() - start)
    return statistics.median(times[steps // 5:])


def bench_training(model_flags: list[str], steps: int) -> tuple[float, float]:
    from megatron_gnmr.experiments.side_by_side import time_training_steps

    base = [*model_flags, "--train-iters", str(10 * steps), "--lr-warmup-iters", "1"]
    times = time_training_steps({"off": base, "on": [*base, "--gnmr"]}, steps)
    return times["off"], times["on"]


TINY = ["--config", "configs/tiny_cpu.yaml"]
LARGER = ["--config", "configs/tiny_cpu.yaml", "--num-layers", "8", "--hidden-size", "512",
          "--ffn-hidden-size", "1408", "--num-attention-heads", "8", "--num-query-groups", "4",
          "--micro-batch-size", "4", "--global-batch-size", "8"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed training steps per model")
    args = parser.parse_args()
    from megatron_gnmr.platform import quiet_known_warnings

    quiet_known_warnings()
    print("policy.step (median over 200 steps):")
    for units in (320, 3_200, 31_000):
        print(f"  {units:>6} units: {bench_policy(units, 200) * 1e3:8.3f} ms")
    print(f"  31,000 units, 0.1% of norms NaN: {bench_policy(31_000, 200, 0.001) * 1e3:.3f} ms")
    print("training step time, --gnmr off vs on (median, same process, alternating):")
    for name, flags in (("tiny (2 x 128)", TINY), ("larger (8 x 512)", LARGER)):
        off, on = bench_training(flags, args.steps)
        print(f"  {name:18s} off {off * 1e3:8.1f} ms  on {on * 1e3:8.1f} ms  "
              f"ratio on/off {on / off:.4f} ({(on / off - 1) * 100:+.2f}%)")


if __name__ == "__main__":
    main()
