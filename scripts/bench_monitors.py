"""Benchmark: what the mechanism monitors cost, side by side in one run.

1. The D2 spectrum through the QR core vs the SVD of the explicitly formed d_model x d_model
   D2, for one head with d_head 128, at d_model 1024, 2048, 4096 (float64, as the monitor).
2. The monitors' share of training step time on the tiny CPU model at interval 1, 10, 100
   (attention monitor, delta = interval), against the same model without monitors.

    .venv/bin/python scripts/bench_monitors.py [--steps 200]
"""

from __future__ import annotations

import argparse
import time

import torch


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def bench_d2(d_model: int, d_head: int = 128) -> tuple[float, float, float]:
    from megatron_gnmr.monitors.spectra import d2_singular_values

    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(d_model, d_head, generator=generator, dtype=torch.float64)
            for _ in range(2))
    da, db = (1e-3 * torch.randn(d_model, d_head, generator=generator, dtype=torch.float64)
              for _ in range(2))
    core = median_time(lambda: d2_singular_values(a, b, da, db), 5)
    full = median_time(lambda: torch.linalg.svdvals(da @ b.T + a @ db.T), 1 if d_model > 2048
                       else 3)
    explicit = torch.linalg.svdvals(da @ b.T + a @ db.T)[: 2 * d_head]
    ours = torch.sort(d2_singular_values(a, b, da, db), descending=True).values
    error = float(((ours - explicit).abs() / explicit[0]).max())
    return core, full, error


def bench_share(steps: int) -> dict[str, float]:
    from megatron_gnmr.experiments.side_by_side import time_training_steps

    base = ["--config", "configs/tiny_cpu.yaml", "--train-iters", str(steps + 10),
            "--lr-warmup-iters", "1"]
    variants = {"off": base}
    for interval in (1, 10, 100):
        variants[f"interval {interval}"] = [*base, "--monitors", "attention",
                                            "--monitor-interval", str(interval),
                                            "--monitor-delta", str(interval)]
    return time_training_steps(variants, steps, mean=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200,
                        help="training steps per variant (>= 100 to include an interval-100 check)")
    args = parser.parse_args()
    from megatron_gnmr.platform import quiet_known_warnings

    quiet_known_warnings()
    torch.set_num_threads(1)
    print("D2 spectrum, one head, d_head 128, float64, 1 thread:")
    for d_model in (1024, 2048, 4096):
        core, full, error = bench_d2(d_model)
        print(f"  d_model {d_model}: QR core {core * 1e3:8.2f} ms, SVD of formed D2 "
              f"{full * 1e3:9.1f} ms, speed-up x{full / core:6.0f}, max |ds|/s_max {error:.1e}")
    torch.set_num_threads(2)
    times = bench_share(args.steps)
    print(f"tiny CPU model, mean step time over {args.steps} steps (monitor steps included):")
    for name, seconds in times.items():
        share = (seconds / times["off"] - 1) * 100
        print(f"  {name:12s} {seconds * 1e3:8.2f} ms   monitors' share {share:+6.2f}%")


if __name__ == "__main__":
    main()
