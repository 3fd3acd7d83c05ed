"""Benchmark: what emulated low precision costs, measured side by side in one process.

1. Each quantizer on a 2048 x 2048 float32 tensor, per call, against the native cast where
   torch has one (float8 E4M3/E5M2) or a float32 -> bf16 -> float32 round trip (the cheapest
   cast there is) where it has none, and against the 2048^3 float32 GEMM it would feed.
2. What torch.compile would buy: the float32 rounding compiled against eager, its compile
   time, and the calls it takes to pay that back (the product runs eager: see the output).
3. Each recipe's training step time on the tiny CPU model, as a ratio to no emulation, and the
   share of that step spent inside the quantizer (timed around every call).

    .venv/bin/python scripts/bench_precision.py [--steps 10] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

RECIPES = {
    "none (fp32)": [],
    "none --bf16": ["--bf16"],
    "fp8-emulated": ["--precision-recipe", "fp8-emulated"],
    "fp8-emulated blockwise": ["--precision-recipe", "fp8-emulated", "--fp8-recipe", "blockwise"],
    "deepseek": ["--precision-recipe", "deepseek"],
    "act-quant 4/8": ["--precision-recipe", "act-quant"],
}
QUANTIZERS = [  # (label, format, granularity, pow2, native torch dtype or None)
    ("e4m3 tensor", "e4m3", "tensor", False, torch.float8_e4m3fn),
    ("e5m2 tensor", "e5m2", "tensor", False, torch.float8_e5m2),
    ("e4m3 1x128 tiles, pow2", "e4m3", "tile", True, torch.float8_e4m3fn),
    ("e4m3 128x128 blocks, pow2", "e4m3", "block", True, torch.float8_e4m3fn),
    ("e4m3 mx (1x32, E8M0)", "e4m3", "mx", False, torch.float8_e4m3fn),
    ("e2m3 1x128 tiles, pow2", "e2m3", "tile", True, None),
    ("e3m2 tensor", "e3m2", "tensor", False, None),
    ("e2m1 tensor", "e2m1", "tensor", False, None),
    ("int4 tensor", "int4", "tensor", False, None),
]


def best_of(function, repeats: int) -> float:
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def quantizer_table(repeats: int) -> None:
    from megatron_gnmr.precision.scaling import QuantSpec, quantize

    torch.manual_seed(0)
    x = torch.randn(2048, 2048)
    gemm = best_of(lambda: x @ x, max(3, repeats // 4))
    bf16 = best_of(lambda: x.to(torch.bfloat16).float(), repeats)
    print(f"quantizers on a 2048 x 2048 float32 tensor (best of {repeats}); "
          f"a 2048^3 float32 GEMM takes {gemm * 1e3:.1f} ms")
    print(f"  {'quantizer':30s} {'ms':>8s} {'cast ms':>8s} {'x cast':>7s} {'% of GEMM':>9s}")
    for label, fmt, granularity, pow2, native in QUANTIZERS:
        spec = QuantSpec(fmt, granularity, pow2)
        ours = best_of(lambda: quantize(x, spec), repeats)
        cast = best_of(lambda: x.to(native).float(), repeats) if native else bf16
        kind = "" if native else " (bf16)"
        print(f"  {label:30s} {ours * 1e3:8.2f} {cast * 1e3:8.2f}{kind:7s} x{ours / cast:5.1f}"
              f" {100 * ours / gemm:8.1f}%")


def compile_table(repeats: int) -> None:
    from megatron_gnmr.precision.formats import E4M3, magic_round_

    torch.manual_seed(0)
    x = torch.randn(2048, 2048) * 100

    def eager(t):
        return magic_round_(t.clone(), E4M3, saturate=True)

    compiled = torch.compile(eager, dynamic=True)
    start = time.perf_counter()
    same = torch.equal(compiled(x), eager(x))
    first = time.perf_counter() - start
    start = time.perf_counter()
    compiled(torch.randn(512, 1024))
    reshape = time.perf_counter() - start
    eager_ms, compiled_ms = (best_of(lambda f=f: f(x), repeats) * 1e3
                             for f in (eager, compiled))
    saved = (eager_ms - compiled_ms) / 1e3
    print(f"\ntorch.compile of the E4M3 rounding (2048 x 2048): eager {eager_ms:.2f} ms, "
          f"compiled {compiled_ms:.2f} ms, bit-identical {same}; compile {first:.1f} s, "
          f"{reshape:.1f} s more for a second shape: pays back after "
          f"~{(first + reshape) / max(saved, 1e-9):.0f} calls of this size")


def step_table(steps: int) -> None:
    from megatron_gnmr.experiments import side_by_side
    from megatron_gnmr.precision import paths, probes

    spent = {"seconds": 0.0}
    original = paths.quantize

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent["seconds"] += time.perf_counter() - start

    paths.quantize = probes.quantize = timed
    base = ["--config", "configs/tiny_cpu.yaml", "--train-iters", "1000", "--lr-warmup-iters",
            "1"]
    runs = side_by_side.train_side_by_side(
        {name: [*base, *flags] for name, flags in RECIPES.items()}, steps)
    print(f"\ntiny CPU model, {steps} steps side by side: median step time, ratio to no "
          "emulation (fp32), share of the step inside the quantizer")
    # The quantizer time is attributed by re-timing each variant's steps alone.
    reference = statistics.median(runs["none (fp32)"].seconds)
    for name, run in runs.items():
        spent["seconds"] = 0.0
        start = time.perf_counter()
        for step in range(steps):
            run.trainer.train_step(1000 + step)
        total = time.perf_counter() - start
        median = statistics.median(run.seconds)
        print(f"  {name:24s} {median * 1e3:8.1f} ms   x{median / reference:.2f}   "
              f"quantizing {100 * spent['seconds'] / total:4.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    from megatron_gnmr.platform import quiet_known_warnings

    quiet_known_warnings()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    quantizer_table(args.repeats)
    compile_table(args.repeats)
    step_table(args.steps)


if __name__ == "__main__":
    main()
