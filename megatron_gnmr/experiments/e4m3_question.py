"""Why did emulated E4M3 train worse than coarser formats? (issue 24)

    .venv/bin/python -m megatron_gnmr.experiments.e4m3_question [--smoke] [--jobs 2]

The risk_signals_deepseek model (2 layers x 128, lr 3e-3, 400 steps) trained with one low
path on every unit linear (or on a subset), each run an ordinary training process; the gap
is the training loss over the last tenth of the steps minus full precision's on the same
seed and batches. The variants separate the hypotheses:

- a defect of the project's emulation: the same low path through an independent
  implementation (this module's own autograd function and quantizer: torch's float8 cast
  for E4M3, ml_dtypes for FP6, scales computed here), and the same format with exact
  instead of power-of-two scales;
- the size of the error or its structure: Gaussian noise with the same per-tensor error
  norm as E4M3 (or E3M2) rounding, in place of the rounding; stochastic instead of
  round-to-nearest;
- where the damage is: one unit type (qkv, proj, fc1, fc2), one layer;
- the optimizer and the model: a lower learning rate, a wider model, more seeds.

Each run is a child process of this module (`--run VARIANT --seed S --out DIR`) that
registers its variant in the project's extension points (a precision backend whose low path
is the variant's, a GEMM kernel where the variant computes the GEMMs itself, a precision
config file keeping the other units exact) and calls `pretrain_llama.main` with them. (Until
issue 33 it patched the project's functions instead; the stochastic and noise variants now
quantize inside this module's kernel, the same arithmetic, so a rerun may draw the generator
in another order than section 8's runs did.)
Results: `results/e4m3_question/` (results.md, results.json, one run directory per run).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from megatron_gnmr.experiments.runner import run_log
from megatron_gnmr.model_families.llama import PROJ, QKV  # the question's model is LLaMA's

REPO = Path(__file__).resolve().parents[2]
BASE = ["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "384",
        "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "128",
        "--micro-batch-size", "8", "--global-batch-size", "8", "--train-iters", "400",
        "--lr", "3.0e-3", "--min-lr", "3.0e-4", "--lr-warmup-iters", "20",
        "--log-interval", "1", "--eval-interval", "200", "--eval-iters", "8",
        "--image-interval", "0"]
SMOKE = ["--train-iters", "20", "--eval-interval", "20", "--eval-iters", "2",
         "--lr-warmup-iters", "2"]
WIDER = ["--hidden-size", "256", "--ffn-hidden-size", "768", "--num-attention-heads", "8",
         "--num-query-groups", "4"]
LOWER_LR = ["--lr", "1.0e-3", "--min-lr", "1.0e-4"]


@dataclass(frozen=True)
class Variant:
    description: str
    operands: dict = field(default_factory=dict)  # input/weight/grad -> format name
    pow2: bool = True
    rounding: str = "nearest"  # nearest | stochastic | noise | independent
    units: str | None = None  # regex: only these units run the low path
    flags: tuple = ()
    baseline: str = "full"  # the full-precision run the gap is taken against
    seeds: tuple = (3,)


FWD = ("input", "weight")
ALL = ("input", "weight", "grad")


def _ops(fmt: str, kinds=ALL) -> dict:
    return {kind: fmt for kind in kinds}


MORE_SEEDS = (3, 4, 5, 6, 7, 8, 9)  # the main comparison: seed-to-seed spread measured
FEW_SEEDS = (3, 4, 5)
VARIANTS = {
    "full": Variant("no quantization", seeds=MORE_SEEDS),
    "e3m2-all": Variant("E3M2 input/weight/grad (the deepseek low path)", _ops("e3m2"),
                        seeds=MORE_SEEDS),
    "e4m3-all": Variant("E4M3 input/weight/grad (the deepseek recovery path)", _ops("e4m3"),
                        seeds=MORE_SEEDS),
    "e4m3-fwd": Variant("E4M3 input + weight", _ops("e4m3", FWD), seeds=MORE_SEEDS),
    "e3m2-fwd": Variant("E3M2 input + weight", _ops("e3m2", FWD), seeds=MORE_SEEDS),
    "e4m3-fwd-independent": Variant(
        "E4M3 input + weight, independent implementation (torch float8 cast, own autograd)",
        _ops("e4m3", FWD), rounding="independent", seeds=FEW_SEEDS),
    "e4m3-all-independent": Variant("E4M3 everywhere, independent implementation",
                                    _ops("e4m3"), rounding="independent"),
    "e4m3-fwd-exact-scales": Variant("E4M3 input + weight, exact (not power-of-two) scales",
                                     _ops("e4m3", FWD), pow2=False),
    "e4m3-fwd-stochastic": Variant("E4M3 input + weight, stochastic rounding",
                                   _ops("e4m3", FWD), rounding="stochastic"),
    "noise-as-e4m3-fwd": Variant("Gaussian noise with E4M3's error norm, input + weight",
                                 _ops("e4m3", FWD), rounding="noise", seeds=FEW_SEEDS),
    "noise-as-e3m2-fwd": Variant("Gaussian noise with E3M2's error norm, input + weight",
                                 _ops("e3m2", FWD), rounding="noise"),
    "e4m3-fwd-qkv": Variant(f"E4M3 input + weight, {QKV} only", _ops("e4m3", FWD),
                            units=rf"{QKV}$", seeds=FEW_SEEDS),
    "e4m3-fwd-proj": Variant(f"E4M3 input + weight, {PROJ} only", _ops("e4m3", FWD),
                             units=rf"{PROJ}$"),
    "e4m3-fwd-fc1": Variant("E4M3 input + weight, linear_fc1 only", _ops("e4m3", FWD),
                            units=r"linear_fc1$"),
    "e4m3-fwd-fc2": Variant("E4M3 input + weight, linear_fc2 only", _ops("e4m3", FWD),
                            units=r"linear_fc2$"),
    "e4m3-fwd-layer0": Variant("E4M3 input + weight, layer 0 only", _ops("e4m3", FWD),
                               units=r"^layers\.0\."),
    "e4m3-fwd-layer1": Variant("E4M3 input + weight, layer 1 only", _ops("e4m3", FWD),
                               units=r"^layers\.1\."),
    "full-lr1e-3": Variant("no quantization, lr 1e-3", flags=tuple(LOWER_LR)),
    "e4m3-fwd-lr1e-3": Variant("E4M3 input + weight, lr 1e-3", _ops("e4m3", FWD),
                               flags=tuple(LOWER_LR), baseline="full-lr1e-3"),
    "e3m2-fwd-lr1e-3": Variant("E3M2 input + weight, lr 1e-3", _ops("e3m2", FWD),
                               flags=tuple(LOWER_LR), baseline="full-lr1e-3"),
    "full-wide": Variant("no quantization, 2 x 256", flags=tuple(WIDER)),
    "e4m3-fwd-wide": Variant("E4M3 input + weight, 2 x 256", _ops("e4m3", FWD),
                             flags=tuple(WIDER), baseline="full-wide"),
    "e3m2-fwd-wide": Variant("E3M2 input + weight, 2 x 256", _ops("e3m2", FWD),
                             flags=tuple(WIDER), baseline="full-wide"),
}


# -- the low path of a variant, installed into the child process ----------------------------
MAX = {"e4m3": 448.0, "e3m2": 28.0, "e5m2": 57344.0, "e2m3": 7.5}
GRANULARITY = {"input": "tile", "weight": "block", "grad": "tile"}


def install(variant: Variant, seed: int, out: Path, config_flags: list[str]) -> list[str]:
    """Register the variant's low path in the project's extension points (a backend of its
    own; for the independent, stochastic and noise variants a GEMM kernel of its own too) and
    return the flags that select it: every unit linear runs the low path, or only those
    matching `variant.units` (the others are kept exact through a precision config file)."""
    from megatron_gnmr.precision.backends import BACKENDS, Backend
    from megatron_gnmr.precision.kernels import KERNELS
    from megatron_gnmr.precision.paths import GemmPath
    from megatron_gnmr.precision.recipes import EXACT, Recipe
    from megatron_gnmr.precision.scaling import QuantSpec

    specs = {kind: QuantSpec(fmt, GRANULARITY[kind], variant.pow2)
             for kind, fmt in variant.operands.items()}
    kernel = "emulated"  # the project's own quantizer and GEMMs (round to nearest)
    if variant.rounding != "nearest":
        import torch

        kernel = f"e4m3-question-{variant.rounding}"
        generator = torch.Generator().manual_seed(10_000 + seed)
        KERNELS[kernel] = independent_kernel(variant.rounding, generator)
    low = GemmPath("question", **specs, kernel=kernel)
    BACKENDS[RECIPE] = Backend(recipe=lambda precision: Recipe(RECIPE, low, EXACT))
    flags = ["--precision-recipe", RECIPE]
    if variant.units:
        flags += ["--precision-config-file", str(_kept_exact(variant.units, out,
                                                             config_flags + flags))]
    return flags


RECIPE = "e4m3-question"


def _kept_exact(pattern: str, out: Path, flags: list[str]) -> Path:
    """A precision config file keeping exact every unit linear that `pattern` misses."""
    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.controller.units import UnitShape
    from megatron_gnmr.precision import precision_config_file

    names = UnitShape.of(parse_config(flags)).names()
    path = out / "kept_exact.yaml"
    out.mkdir(parents=True, exist_ok=True)
    precision_config_file.write(str(path), [name for name in names
                                            if not re.search(pattern, name)],
                                note=f"units outside {pattern!r} stay exact")
    return path


def _quantize_independently(x, spec, rounding: str = "nearest", generator=None):
    """This module's own scaled quantization (not `precision/scaling.py`): 1x128 tiles or
    128x128 blocks, scale = max / amax (floored to a power of two if asked), the format's
    grid by torch's float8 cast (E4M3, E5M2) or ml_dtypes (FP6), dequantized by division."""
    import torch

    shape, top = x.shape, MAX[spec.format]
    matrix = x.float().reshape(-1, shape[-1])
    rows, cols = matrix.shape
    if spec.granularity == "block":
        assert rows % 128 == 0 and cols % 128 == 0, matrix.shape
        blocks = matrix.reshape(rows // 128, 128, cols // 128, 128)
        amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    else:
        assert cols % 128 == 0, matrix.shape
        blocks = matrix.reshape(rows, cols // 128, 128)
        amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, top / amax, torch.ones_like(amax))
    if spec.pow2_scale:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    scaled = (blocks * scale).clamp(-top, top)
    if rounding == "stochastic":
        rounded = _stochastic(scaled, spec.format, generator)
    else:
        rounded = _nearest(scaled, spec.format)
    result = (rounded / scale).reshape(shape)
    if rounding == "noise":  # the rounding's error norm, as unstructured Gaussian noise
        error = float((result - x.float()).norm())
        noise = torch.randn(x.shape, generator=generator)
        result = x.float() + noise * (error / float(noise.norm()))
    return result.to(x.dtype)


def _nearest(scaled, fmt: str):
    import ml_dtypes
    import numpy as np
    import torch

    if fmt == "e4m3":
        return scaled.to(torch.float8_e4m3fn).float()
    if fmt == "e5m2":
        return scaled.to(torch.float8_e5m2).float()
    dtype = {"e3m2": ml_dtypes.float6_e3m2fn, "e2m3": ml_dtypes.float6_e2m3fn}[fmt]
    values = scaled.detach().numpy().astype(dtype).astype(np.float32)
    return torch.from_numpy(values)


def _stochastic(scaled, fmt: str, generator):
    """Round |v| down or up to its two neighbours on the format's grid with probability
    proportional to the distance (unbiased); the grid's quantum from v's exponent."""
    import torch

    mantissa, min_exponent = {"e4m3": (3, -6), "e3m2": (2, -2), "e5m2": (2, -14),
                              "e2m3": (3, 0)}[fmt]
    magnitude = scaled.abs()
    exponent = torch.floor(torch.log2(torch.where(magnitude > 0, magnitude, 1.0)))
    quantum = torch.exp2(exponent.clamp(min=min_exponent) - mantissa)
    low = torch.floor(magnitude / quantum) * quantum
    up = torch.rand(magnitude.shape, generator=generator) < (magnitude - low) / quantum
    rounded = torch.where(up, low + quantum, low).clamp(max=MAX[fmt])
    return torch.copysign(rounded, scaled)


def independent_kernel(rounding: str, generator=None):
    """A GEMM kernel (`precision/kernels.py`) built on this module's own quantizer and
    autograd function, rounding as the variant asks: `independent` to nearest, `stochastic`,
    or `noise` (the rounding's error norm as Gaussian noise)."""
    def quantize(x, spec):
        return _quantize_independently(x, spec, "nearest" if rounding == "independent"
                                       else rounding, generator)

    def kernel(x, weight, bias, path, allreduce_dgrad, tp_group, probe, parallel):
        assert bias is None and not allreduce_dgrad, "the independent path is TP=1, no bias"
        return _independent_function().apply(x, weight, path, quantize)

    return kernel


@functools.lru_cache(maxsize=None)
def _independent_function():
    import torch

    class IndependentLinear(torch.autograd.Function):
        """y = Q_in(x) Q_w(W)^T; dx = Q_g(dy) Q_w(W); dW = Q_g(dy)^T Q_in(x)."""

        @staticmethod
        def forward(ctx, x, weight, path, quantize):
            x_q = x if path.input is None else quantize(x, path.input)
            w_q = weight if path.weight is None else quantize(weight, path.weight)
            ctx.save_for_backward(x_q, w_q)
            ctx.path, ctx.quantize = path, quantize
            return torch.matmul(x_q, w_q.t())

        @staticmethod
        def backward(ctx, grad_output):
            x_q, w_q = ctx.saved_tensors
            spec = ctx.path.grad
            g_q = grad_output if spec is None else ctx.quantize(grad_output, spec)
            grad_input = torch.matmul(g_q, w_q)
            grad_weight = torch.matmul(g_q.reshape(-1, g_q.shape[-1]).t(),
                                       x_q.reshape(-1, x_q.shape[-1]))
            return grad_input, grad_weight, None, None

    return IndependentLinear


# -- running the variants ---------------------------------------------------------------------
def child(name: str, seed: int, out: Path, smoke: bool) -> None:
    variant = VARIANTS[name]
    sys.path.insert(0, str(REPO))
    from pretrain_llama import main

    flags = [*BASE, *(SMOKE if smoke else []), *variant.flags, "--seed", str(seed),
             "--save", str(out)]
    if variant.operands:  # megatron's local layers with the path-routed unit linears
        flags += install(variant, seed, out, flags)
    main(flags)


def run_variant(name: str, seed: int, out: Path, smoke: bool) -> Path:
    run_dir = out / f"{name}-seed{seed}"
    if (run_dir / "summary.json").is_file():
        return run_dir
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "megatron_gnmr.experiments.e4m3_question", "--run", name,
               "--seed", str(seed), "--out", str(run_dir)] + (["--smoke"] if smoke else [])
    with run_log(run_dir).open("w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO)
    if result.returncode != 0:
        raise RuntimeError(f"{run_dir.name} failed ({result.returncode}); see "
                           f"{run_log(run_dir)}")
    return run_dir


def summarize(out: Path, smoke: bool) -> dict:
    from megatron_gnmr.experiments.tables import run_figures

    figures = {}
    for name, variant in VARIANTS.items():
        for seed in _seeds(variant, smoke):
            figures[(name, seed)] = run_figures(out / f"{name}-seed{seed}")
    rows = {}
    for name, variant in VARIANTS.items():
        gaps = {seed: figures[(name, seed)]["train_loss_last_tenth"]
                - figures[(variant.baseline, seed)]["train_loss_last_tenth"]
                for seed in _seeds(variant, smoke)}
        valid = [figures[(name, seed)]["final_valid_loss"] for seed in gaps]
        rows[name] = {"description": variant.description, "gaps": gaps,
                      "gap_mean": sum(gaps.values()) / len(gaps),
                      "gap_std": _std(list(gaps.values())),
                      "valid_loss": sum(valid) / len(valid), "baseline": variant.baseline}
    return rows


def _seeds(variant: Variant, smoke: bool) -> tuple:
    return variant.seeds[:1] if smoke else variant.seeds


def _std(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


# (a, b): is a's gap larger than b's? Paired by seed (same batches, same initial weights).
COMPARISONS = [("e4m3-all", "e3m2-all"), ("e4m3-fwd", "e3m2-fwd"),
               ("e4m3-fwd-independent", "e4m3-fwd"), ("e4m3-fwd", "noise-as-e4m3-fwd")]


def paired(rows: dict, a: str, b: str) -> dict:
    """Per-seed difference of two variants' gaps, its mean, spread and a 90% bootstrap
    interval of the mean (seeds resampled, 10k draws, fixed generator)."""
    import numpy as np

    seeds = sorted(set(rows[a]["gaps"]) & set(rows[b]["gaps"]))
    diffs = np.array([rows[a]["gaps"][s] - rows[b]["gaps"][s] for s in seeds])
    draws = np.random.default_rng(0).choice(diffs, size=(10_000, len(diffs))).mean(axis=1)
    return {"seeds": seeds, "diffs": diffs.tolist(), "mean": float(diffs.mean()),
            "std": float(diffs.std(ddof=1)) if len(diffs) > 1 else 0.0,
            "a_worse": int((diffs > 0).sum()),
            "interval": [float(np.quantile(draws, 0.05)), float(np.quantile(draws, 0.95))]}


def write(rows: dict, out: Path, wall: float) -> str:
    lines = ["| variant | what | gap (train, last 10%) | per seed | valid loss | vs |",
             "|---|---|---|---|---|---|"]
    for name, row in rows.items():
        per_seed = " / ".join(f"{gap:+.3f}" for gap in row["gaps"].values())
        spread = f" +- {row['gap_std']:.3f}" if len(row["gaps"]) > 1 else ""
        lines.append(f"| {name} | {row['description']} | {row['gap_mean']:+.3f}{spread} | "
                     f"{per_seed} (seeds {', '.join(map(str, row['gaps']))}) | "
                     f"{row['valid_loss']:.4f} | {row['baseline']} |")
    lines += ["", "| a vs b (paired by seed) | a - b, mean | spread | 90% interval | "
              "seeds where a is worse |", "|---|---|---|---|---|"]
    comparisons = {}
    for a, b in COMPARISONS:
        c = comparisons[f"{a} vs {b}"] = paired(rows, a, b)
        lines.append(f"| {a} vs {b} | {c['mean']:+.4f} | {c['std']:.4f} | "
                     f"[{c['interval'][0]:+.4f}, {c['interval'][1]:+.4f}] | "
                     f"{c['a_worse']} of {len(c['seeds'])} |")
    text = "\n".join(lines) + f"\n\n({len(rows)} variants, {wall / 60:.0f} min)\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(
        {"variants": {name: {**row, "gaps": {str(k): v for k, v in row["gaps"].items()}}
                      for name, row in rows.items()},
         "comparisons": comparisons}, indent=2))
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="20 steps, one seed")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--only", default=None, help="regex: run only matching variants")
    parser.add_argument("--out", default=None)
    parser.add_argument("--run", help=argparse.SUPPRESS)  # child: one variant
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        return child(args.run, args.seed, Path(args.out), args.smoke)
    out = Path(args.out or REPO / "results" / ("e4m3_question" + ("-smoke" if args.smoke
                                                                     else "")))
    out.mkdir(parents=True, exist_ok=True)
    wanted = [name for name in VARIANTS if not args.only or re.search(args.only, name)]
    jobs = [(name, seed) for name in wanted for seed in _seeds(VARIANTS[name], args.smoke)]
    start = time.time()
    from tqdm import tqdm

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_variant, name, seed, out, args.smoke) for name, seed in jobs]
        for future in tqdm(as_completed(futures), total=len(futures), desc="e4m3 question",
                           unit="run"):
            future.result()
    if not args.only:
        print(write(summarize(out, args.smoke), out, time.time() - start))


if __name__ == "__main__":
    main()
