"""Benchmark: step time of each emulated precision recipe relative to no emulation, on CPU,
measured side by side in one process (emulation costs; this says how much).

    .venv/bin/python scripts/bench_precision.py [--steps 10]
"""

from __future__ import annotations

import argparse

RECIPES = {
    "none (fp32)": [],
    "none --bf16": ["--bf16"],
    "fp8-emulated": ["--precision-recipe", "fp8-emulated"],
    "fp8-emulated blockwise": ["--precision-recipe", "fp8-emulated", "--fp8-recipe", "blockwise"],
    "deepseek": ["--precision-recipe", "deepseek"],
    "act-quant 4/8": ["--precision-recipe", "act-quant"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    from megatron_gnmr.platform import quiet_known_warnings
    from megatron_gnmr.experiments.side_by_side import time_training_steps

    quiet_known_warnings()
    base = ["--config", "configs/tiny_cpu.yaml", "--train-iters", "1000", "--lr-warmup-iters", "1"]
    times = time_training_steps({name: [*base, *flags] for name, flags in RECIPES.items()},
                                args.steps)
    reference = times["none (fp32)"]
    print("tiny CPU model, median step time, ratio to no emulation (fp32):")
    for name, seconds in times.items():
        print(f"  {name:24s} {seconds * 1e3:8.1f} ms   x{seconds / reference:.2f}")


if __name__ == "__main__":
    main()
