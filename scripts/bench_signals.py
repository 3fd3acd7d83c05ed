"""Benchmark: what the risk signals cost per training step, measured side by side in one
process on the tiny CPU model with act-quant 3/8 and the controller on:
GNMR alone, + qerr probes (one extra norm pass per quantized operand, plus the shadow
quantization of recovered units), + the oracle's side GEMMs (experiments only).

    .venv/bin/python scripts/bench_signals.py [--steps 20] [--size 8x512]

`--probe-share` measures instead what the qerr probes cost inside a `gnmr,qerr` step, in CPU
time of the training thread (immune to other processes on the machine): the time spent in the
probes' two hooks over the step's time. Measured at 8x512: 2.1% of the step before the probes
summed with fused norms, 1.45% after.

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
    parser.add_argument("--probe-share", action="store_true",
                        help="the qerr probes' share of a step, in thread CPU time")
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
    if args.probe_share:
        probe_share([*base, *VARIANTS["gnmr,qerr"]], args.steps, args.size or "tiny")
        return
    times = time_training_steps({name: [*base, *flags] for name, flags in VARIANTS.items()},
                                args.steps)
    reference = times["gnmr"]
    print(f"{args.size or 'tiny'} CPU model, act-quant 3/8, median step time, ratio to GNMR "
          "alone:")
    for name, seconds in times.items():
        print(f"  {name:30s} {seconds * 1e3:8.1f} ms   x{seconds / reference:.3f}")


def probe_share(flags: list[str], steps: int, size: str) -> None:
    """Thread CPU time inside the probes' hooks over the step's (both measured in-process)."""
    import statistics
    import time

    from megatron_gnmr.experiments import side_by_side
    from megatron_gnmr.precision import probes

    spent = [0.0]
    for name in ("forward_operands", "grad_operand"):  # timed wrappers, this process only
        original = getattr(probes.UnitProbe, name)

        def timed(self, *args, _original=original, **kwargs):
            start = time.thread_time()
            result = _original(self, *args, **kwargs)
            spent[0] += time.thread_time() - start
            return result
        setattr(probes.UnitProbe, name, timed)
    side_by_side.time.perf_counter = time.thread_time  # steps in the same clock
    warmup = 1
    run = side_by_side.train_side_by_side({"qerr": flags}, steps, warmup)["qerr"]
    step = statistics.fmean(run.seconds)
    per_step = spent[0] / (steps + warmup)
    print(f"{size}: the qerr probes take {per_step * 1e3:.1f} ms of a {step * 1e3:.0f} ms step "
          f"(thread CPU time): {100 * per_step / step:.2f}%")


if __name__ == "__main__":
    main()
