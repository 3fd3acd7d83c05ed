"""Benchmark: the path without Transformer Engine at speed (issue 59), every ratio measured side
by side in one process.

For each model size, one trainer per variant, stepped in rotating order (machine drift hits
every variant alike), the median step time of each:

- core attention: megatron's unfused attention (--attention-backend local) against torch's
  SDPA (the default), unquantized: the ratio unfused / SDPA (goal on the CPU: >= 1.3 at
  sequence 1024);
- emulated FP8 (fp8-emulated, tensorwise): eager quantizers (--quantizer-compile off) against
  compiled ones (on), each as a ratio to the unquantized step (goal on the CPU: compiled
  within 1.03x), and eager / compiled;
- with --layers, also torch.compile per layer (--compile), unquantized and FP8.

Then each quantizer size eager against compiled (whether compiling pays, and from what size:
`--quantizer-compile auto` compiles GPU tensors from 2^16 elements, CPU tensors never).
Sizes: `tiny` (configs/tiny_cpu.yaml: 2 layers x 128, sequence 128) and `8x512` (8 layers x
512, 8 heads in 4 groups, sequence 1024, one sequence per step).

    .venv/bin/python scripts/bench_speed.py                       # both sizes (CPU: ~30 min)
    .venv/bin/python scripts/bench_speed.py --sizes tiny --steps 2 --warmup 1   # a smoke run
    .venv/bin/python scripts/bench_speed.py --sizes 8x512 --only attention      # SDPA alone
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

BASE = ["--config", "configs/tiny_cpu.yaml", "--train-iters", "1000", "--lr-warmup-iters", "1",
        "--eval-iters", "1"]
SIZES = {
    "tiny": [],
    "8x512": ["--num-layers", "8", "--hidden-size", "512", "--ffn-hidden-size", "1408",
              "--num-attention-heads", "8", "--num-query-groups", "4", "--seq-length", "1024",
              "--micro-batch-size", "1", "--global-batch-size", "1"],
}
FP8 = ["--precision-recipe", "fp8-emulated"]
VARIANTS = {
    "unfused attention": ["--attention-backend", "local"],
    "sdpa attention": [],
    "fp8 eager quantizers": [*FP8, "--quantizer-compile", "off"],
    "fp8 compiled quantizers": [*FP8, "--quantizer-compile", "on"],
}
LAYER_VARIANTS = {
    "compiled layers": ["--compile"],
    "fp8 compiled layers": [*FP8, "--compile"],
}


def size_table(size: str, steps: int, warmup: int, layers: bool, only: str | None) -> dict:
    from megatron_gnmr.gpu_check.arms import Stepper, build_trainers

    variants = {**VARIANTS, **(LAYER_VARIANTS if layers else {})}
    if only == "attention":  # a busy machine's share: the attention pair alone
        variants = {name: flags for name, flags in variants.items() if "attention" in name}
    trainers = build_trainers({name: [*BASE, *SIZES[size], *flags]
                               for name, flags in variants.items()})
    try:
        seconds, _ = Stepper(trainers).side_by_side(list(trainers), steps, warmup)
        median = {name: statistics.median(times) for name, times in seconds.items()}
    finally:
        for trainer in trainers.values():
            trainer.close()
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    reference = median["sdpa attention"]
    print(f"\n{size}: median of {steps} steps after {warmup} warm-up, side by side")
    print(f"  {'variant':26s} {'ms/step':>9s} {'x unquantized (sdpa)':>21s}")
    for name, seconds in median.items():
        print(f"  {name:26s} {seconds * 1e3:9.1f} {seconds / reference:20.3f}x")
    ratios = {"unfused / sdpa": median["unfused attention"] / reference}
    if "fp8 eager quantizers" in median:
        ratios.update({
            "fp8 eager / unquantized": median["fp8 eager quantizers"] / reference,
            "fp8 compiled / unquantized": median["fp8 compiled quantizers"] / reference,
            "fp8 eager / compiled": median["fp8 eager quantizers"] /
            median["fp8 compiled quantizers"]})
    if layers:
        ratios["fp8 compiled layers / unquantized"] = median["fp8 compiled layers"] / reference
    for name, ratio in ratios.items():
        print(f"  {name:34s} {ratio:6.3f}")
    return {"median_s": median, "ratios": ratios}


def quantizer_sizes(repeats: int) -> dict:
    """E4M3 per-tensor quantization, eager against compiled, by tensor size."""
    from megatron_gnmr.precision import scaling
    from megatron_gnmr.precision.scaling import QuantSpec, quantize

    spec, rows = QuantSpec("e4m3"), {}
    print(f"\ne4m3 per-tensor quantizer, eager against compiled (best of {repeats}); "
          f"auto compiles GPU tensors from {scaling.AUTO_COMPILE_NUMEL} elements")
    print(f"  {'elements':>9s} {'eager ms':>9s} {'compiled ms':>12s} {'eager/compiled':>15s}")
    for power in range(12, 23, 2):
        x = torch.randn(1 << power)
        times = {}
        for mode in ("off", "on"):
            scaling.set_quantizer_compile(mode)
            quantize(x, spec)  # the compilation, once
            best = []
            for _ in range(repeats):
                start = time.perf_counter()
                quantize(x, spec)
                best.append(time.perf_counter() - start)
            times[mode] = min(best)
        rows[1 << power] = times
        print(f"  {1 << power:9d} {times['off'] * 1e3:9.3f} {times['on'] * 1e3:12.3f} "
              f"{times['off'] / times['on']:15.2f}")
    scaling.set_quantizer_compile("auto")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,8x512", help="comma list of: tiny, 8x512")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring "
                        "(compilation happens in the first)")
    parser.add_argument("--layers", action="store_true", help="also --compile (per layer)")
    parser.add_argument("--repeats", type=int, default=20, help="quantizer timings")
    parser.add_argument("--only", choices=("attention",), help="only the unfused and SDPA "
                        "attention variants (no FP8, no quantizer sizes)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    from megatron_gnmr.platform import quiet_known_warnings

    quiet_known_warnings()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{'CUDA' if torch.cuda.is_available() else 'CPU'}")
    results = {size: size_table(size, args.steps, args.warmup, args.layers, args.only)
               for size in args.sizes.split(",")}
    if args.only is None:
        results["quantizer"] = quantizer_sizes(args.repeats)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
