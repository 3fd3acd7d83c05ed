"""Benchmark: what the risk signals cost per training step, measured side by side in one
process on the tiny CPU model with act-quant 3/8 and the controller on:
GNMR alone, + qerr probes (one extra norm pass per quantized operand, plus the shadow
quantization of recovered units), + the oracle's side GEMMs (experiments only).

    .venv/bin/python scripts/bench_signals.py [--steps 20] [--size 8x512]

`--size LAYERSxHIDDEN` measures a larger model (FFN 2.75 x hidden, 64-wide heads, 2 heads
per query group): the probes' share falls with width, since they cost a pass over each
quantized operand and the GEMMs cost that times the other dimension.
"""

from __future__ import annotations

import argparse

VARIANTS = {
    "act-quant 3/8, no controller": [],
    "gnmr": ["--gnmr"],
    "gnmr,qerr": ["--gnmr", "--gnmr-signals", "gnmr,qerr"],
    "gnmr + measure qerr,oracle": ["--gnmr", "--gnmr-measure", "qerr,oracle"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", default=None, help="LAYERSxHIDDEN, e.g. 8x512")
    args = parser.parse_args()
    from megatron_gnmr.platform import quiet_known_warnings
    from megatron_gnmr.experiments.side_by_side import time_training_steps

    quiet_known_warnings()
    base = ["--config", "configs/tiny_cpu.yaml", "--train-iters", "1000", "--lr-warmup-iters",
            "1", "--precision-recipe", "act-quant", "--act-quant-bits", "3",
            "--gnmr-budget-rate", "0.125"]
    if args.size:
        layers, hidden = (int(part) for part in args.size.split("x"))
        heads = max(1, hidden // 64)
        base += ["--num-layers", str(layers), "--hidden-size", str(hidden), "--ffn-hidden-size",
                 str(16 * round(2.75 * hidden / 16)), "--num-attention-heads", str(heads),
                 "--num-query-groups", str(max(1, heads // 2))]
    times = time_training_steps({name: [*base, *flags] for name, flags in VARIANTS.items()},
                                args.steps)
    reference = times["gnmr"]
    print(f"{args.size or 'tiny'} CPU model, act-quant 3/8, median step time, ratio to GNMR "
          "alone:")
    for name, seconds in times.items():
        print(f"  {name:30s} {seconds * 1e3:8.1f} ms   x{seconds / reference:.3f}")


if __name__ == "__main__":
    main()
