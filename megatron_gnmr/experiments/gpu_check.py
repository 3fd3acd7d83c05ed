"""`scripts/gpu_check.sh`: one prepared check of the GPU path, for a person with one GPU.

Prints one table: every capability line; each available precision backend trained side by
side with BF16 from the same seed (loss after N steps, and whether it is within the
tolerance of BF16's); throughput (tokens/s and the ratio to BF16) measured in the same run;
and, for each switchable FP8 backend, whether a unit on the recovery path computes bitwise
what its BF16 layer computes (forward output) while FP8 is on, and differs when it is not
recovered. Backends that are not installed are named with the reason, and the check still
runs BF16 and the emulated recipe on CUDA. Then the checkpoint rows (gpu_check_resume.py): an
async save resumed on the same layout follows the uninterrupted run, and a checkpoint resumed on
another layout (TP 2 over two GPUs, else a CPU process) continues it.

    bash scripts/gpu_check.sh [--steps 50] [--out gpu_check.md]
    .venv/bin/python -m megatron_gnmr.experiments.gpu_check --smoke    # CPU: the script itself
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

# A 4-layer slice of a 1B-class LLaMA: GEMMs large enough for FP8 to pay on Hopper, small
# enough for 50 steps of five variants in minutes. Every dim is a multiple of 32 (MXFP8).
GPU_MODEL = ["--num-layers", "4", "--hidden-size", "2048", "--ffn-hidden-size", "5632",
             "--num-attention-heads", "16", "--seq-length", "2048", "--micro-batch-size", "4",
             "--global-batch-size", "4", "--bf16", "--lr", "1e-3"]
SMOKE_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "192",
               "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2",
               "--global-batch-size", "2", "--lr", "3e-3"]
GNMR = ["--gnmr", "--gnmr-agreement-interval", "0"]
LOSS_TOLERANCE = 0.03  # relative to BF16's mean loss over the last 10 steps
WARMUP = 5


def variants(model: list[str], steps: int) -> tuple[dict[str, list[str]], list[str]]:
    """The flags of each variant to run here, and a line per backend that cannot run. The
    first variant is the reference: `bf16` (`fp32` in the CPU smoke run)."""
    from megatron_gnmr.platform import capabilities
    from megatron_gnmr.precision.torchao_compat import torchao_version

    base = [*model, "--train-iters", str(steps + WARMUP + 100), "--lr-warmup-iters", "5",
            "--eval-interval", "100000", "--log-interval", "100000"]
    reference = "bf16" if "--bf16" in model else "fp32"
    runs = {reference: base, "fp8-emulated": [*base, "--precision-recipe", "fp8-emulated"]}
    missing = []
    if torchao_version() is not None:
        torchao = [*base, "--precision-recipe", "fp8-torchao"]
        runs.update({"fp8-torchao": torchao, "fp8-torchao+gnmr": [*torchao, *GNMR]})
    else:
        missing.append("fp8-torchao: torchao is not installed (pip install -e .[torchao])")
    te = capabilities.te_recipe("tensorwise")
    if te:
        te_fp8 = [*base, "--precision-recipe", "te-fp8", "--fp8-recipe", "tensorwise"]
        runs.update({"te-fp8": te_fp8, "te-fp8+gnmr": [*te_fp8, *GNMR]})
    else:
        missing.append(f"te-fp8: {te.reason}")
    return runs, missing


def fp8_context(recipe: str):
    """What megatron wraps each layer's forward in for this recipe (FP8 on)."""
    if recipe != "te-fp8":
        return contextlib.nullcontext()
    from transformer_engine.common.recipe import Float8CurrentScaling

    from megatron_gnmr.platform import capabilities

    te = capabilities.te_module()
    enter = te.autocast if hasattr(te, "autocast") else te.fp8_autocast
    return enter(enabled=True, **{"recipe" if hasattr(te, "autocast") else "fp8_recipe":
                                  Float8CurrentScaling()})


def recovery_is_bf16(trainer, recipe: str) -> tuple[bool, bool]:
    """(every checked unit recovered under FP8 equals its BF16 forward bitwise, every one
    differs when on the low-cost path), for the first layer's units and the last fc2."""
    import torch

    from megatron_gnmr.controller.units import UnitShape, local_unit_modules
    from megatron_gnmr.platform.device import run_device

    config = trainer.config
    units = local_unit_modules(trainer.model, UnitShape.of(config))
    checked = [name for name in units if name.startswith("layers.0.")]
    checked.append(f"layers.{config.model.num_layers - 1}.mlp.linear_fc2")
    equal, differs = True, True
    generator = torch.Generator(device=run_device()).manual_seed(0)
    with torch.no_grad():
        for name in checked:
            module = units[name]
            x = torch.randn(config.model.seq_length, config.training.micro_batch_size,
                            module.weight.shape[1], generator=generator, device=run_device(),
                            dtype=module.weight.dtype)
            runtime, plan = module.precision_runtime, module.precision_runtime.plan
            module.precision_runtime = None  # FP8 off altogether: megatron's BF16 linear
            reference = module(x)[0]
            module.precision_runtime = runtime
            saved = plan.recovery
            with fp8_context(recipe):
                plan.recovery = frozenset({name})
                recovered = module(x)[0]
                plan.recovery = frozenset()
                low = module(x)[0]
            plan.recovery = saved
            equal &= torch.equal(recovered, reference)
            differs &= not torch.equal(low, reference)
    return equal, differs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="training steps per variant")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model and 6 steps: checks the script itself (runs on CPU)")
    parser.add_argument("--out", help="also write the table (markdown) to this file")
    args = parser.parse_args(argv)
    from megatron_gnmr.platform import capabilities, quiet_known_warnings
    from megatron_gnmr.precision.torchao_compat import torchao_version
    from megatron_gnmr.experiments.side_by_side import train_side_by_side

    quiet_known_warnings()
    steps = 6 if args.smoke else args.steps
    model = SMOKE_MODEL if args.smoke else GPU_MODEL
    if not capabilities.cuda() and not args.smoke:
        print(f"gpu_check: no GPU here ({capabilities.cuda().reason}); --smoke runs the "
              "script's CPU path", file=sys.stderr)
        return 2
    runs_flags, missing = variants(model, steps)
    lines = ["# GPU check", "", "| capability | available | detail |", "|---|---|---|"]
    lines += [f"| {name} | {'yes' if c else 'no'} | {c.reason} |"
              for name, c in capabilities.report()]
    version = torchao_version()
    lines.append(f"| torchao | {'yes' if version else 'no'} | "
                 f"{'.'.join(map(str, version)) if version else 'not installed'} |")
    started = time.perf_counter()
    runs = train_side_by_side(runs_flags, steps=steps, warmup=WARMUP)
    reference = runs[next(iter(runs))]
    tokens = reference.trainer.config.training.global_batch_size * \
        reference.trainer.config.model.seq_length
    tail = max(1, min(10, steps))
    reference_loss = statistics.mean(reference.losses[-tail:])
    reference_time = statistics.median(reference.seconds)
    lines += ["", f"{steps + WARMUP} steps per variant, trained side by side from one seed "
                  f"({time.perf_counter() - started:.0f} s); loss = mean of the last {tail} "
                  f"steps; tolerance {LOSS_TOLERANCE:.0%} of the reference (first row)",
              "", "| variant | loss | vs reference | within tolerance | tokens/s "
                  "| speed vs reference | recovery = BF16 (bitwise) | low path differs |",
              "|---|---|---|---|---|---|---|---|"]
    ok = True
    for name, run in runs.items():
        loss = statistics.mean(run.losses[-tail:])
        seconds = statistics.median(run.seconds)
        within = abs(loss - reference_loss) <= LOSS_TOLERANCE * abs(reference_loss)
        recipe = run.trainer.config.precision.precision_recipe
        switch = ("-", "-")
        if recipe in ("te-fp8", "fp8-torchao") and "+gnmr" not in name:
            equal, differs = recovery_is_bf16(run.trainer, recipe)
            switch = ("yes" if equal else "NO", "yes" if differs else "NO")
            ok &= equal and differs
        ok &= within
        lines.append(f"| {name} | {loss:.4f} | {loss - reference_loss:+.4f} | "
                     f"{'yes' if within else 'NO'} | {tokens / seconds:,.0f} | "
                     f"x{reference_time / seconds:.2f} | {switch[0]} | {switch[1]} |")
    import torch

    from megatron_gnmr.experiments import gpu_check_resume

    small = [*SMOKE_MODEL, *([] if args.smoke else ["--bf16"])]
    checks = gpu_check_resume.rows(small, 6 if args.smoke else 20, not args.smoke,
                                   torch.cuda.device_count() if not args.smoke else 0)
    lines += ["", "| checkpoint check | detail | ok |", "|---|---|---|"]
    lines += [f"| {name} | {detail} | {'yes' if good else 'NO'} |"
              for name, detail, good in checks]
    ok &= all(good for _, _, good in checks)
    lines += [""] + [f"not run: {line}" for line in missing]
    lines.append(f"verdict: {'OK' if ok else 'NOT OK'}")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
