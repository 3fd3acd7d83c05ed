"""`scripts/gpu_check.sh`: one prepared check of the GPU path, for a person with one GPU
(meant to take under 8 minutes on an H100 or H200; not yet timed on one). It prints one
table:

- capability: CUDA, Transformer Engine and its FP8 recipes, torchao, the versions;
- (a) te-fp8 recovery: units forced onto the recovery path at step k and back at step k+1;
  forward, dgrad and wgrad bitwise `te` BF16's on captured inputs, and the FP8 output at k+1
  a fresh FP8 forward's (no stale weight cache) (recovery.py);
- (b) FP8 pays: tokens/s of te-fp8 against `te` BF16, and of fp8-torchao against BF16 with
  every layer compiled alike, at 2 layers, hidden 4096, FFN 14336, 32 heads / 8 groups,
  sequence 4096 (speed.py);
- (c) the controller's cost: its step against the step without it, and its own per-step work
  under CUDA-synchronised timers (it decides but recovers nothing: its overhead alone);
- (d) torchao recovery: (a)'s checks for fp8-torchao against megatron's BF16 layers;
- training: each FP8 arm's loss within 3% of its BF16 arm's;
- checkpoint: an async save resumed on the same layout, and a resume on another layout
  (resume.py).

A row that cannot run (Transformer Engine missing, torchao missing, a compile error) fails
with the reason, and the verdict names it. Exit 0 when every row ran and passed.

    bash scripts/gpu_check.sh [--steps 30] [--out gpu_check.md]
    .venv/bin/python -m megatron_gnmr.gpu_check.check --smoke   # CPU: the script itself
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from megatron_gnmr.arguments import OneLineErrorParser
from megatron_gnmr.errors import UserError, exits_cleanly_on_user_error
from megatron_gnmr.gpu_check.table import Row, info, render, rows_or_cannot_run

# A slice of an 8B-class LLaMA (Llama-3-8B's layer): GEMMs large enough for FP8 to pay on
# Hopper. One micro-batch of 4,096 tokens; three arms' weights and optimizer states (about 8
# GB each with the 4,096-word vocabulary) fit one H100 beside one step's activations.
GPU_MODEL = ["--num-layers", "2", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
             "--num-attention-heads", "32", "--num-query-groups", "8", "--seq-length", "4096",
             "--micro-batch-size", "1", "--global-batch-size", "1", "--bf16", "--lr", "1e-3"]
GPU_MODEL_WORDS = ("2 layers, hidden 4096, FFN 14336, 32 heads / 8 query groups, sequence 4096, "
                   "micro-batch 1, BF16")
SMOKE_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "192",
               "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2",
               "--global-batch-size", "2", "--lr", "3e-3"]
SMOKE_MODEL_WORDS = "2 layers, hidden 64, FFN 192, 4 heads, sequence 64, micro-batch 2, FP32"
WARMUP = 5  # steps not timed: compilation, allocation
WORK_STEPS = 10  # steps with the step component's work timed (part (c))
SMOKE = {"steps": 3, "warmup": 2, "work_steps": 2, "backend": "aot_eager"}


def base_flags(model: list[str], steps: int, warmup: int, work_steps: int) -> list[str]:
    """Every arm's flags: the model, and more training steps than the check will take."""
    return [*model, "--train-iters", str(warmup + steps + work_steps + 100),
            "--lr-warmup-iters", "5", "--eval-interval", "100000", "--log-interval", "100000"]


def capability_rows() -> list[Row]:
    import torch

    from megatron_gnmr.platform import capabilities
    from megatron_gnmr.precision.torchao_compat import torchao_version

    rows = [info("capability", "torch", torch.__version__)]
    rows += [info("capability", name, f"{'yes' if c else 'no'}: {c.reason}")
             for name, c in capabilities.report()]
    version = torchao_version()
    rows.append(info("capability", "torchao", ".".join(map(str, version)) if version
                     else "no: not installed"))
    try:
        from megatron.core import package_info

        rows.append(info("capability", "megatron-core", package_info.__version__))
    except ImportError as error:
        rows.append(info("capability", "megatron-core", f"no: {error}"))
    return rows


def checkpoint_rows(smoke: bool) -> list[Row]:
    import torch

    from megatron_gnmr.gpu_check import resume as gpu_check_resume
    from megatron_gnmr.gpu_check.table import judged

    small = [*SMOKE_MODEL, *([] if smoke else ["--bf16"])]
    checks = gpu_check_resume.rows(small, 6 if smoke else 20, not smoke,
                                   0 if smoke else torch.cuda.device_count())
    return [judged("checkpoint", name, detail, good) for name, detail, good in checks]


def parse(argv: list[str] | None):
    parser = OneLineErrorParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30,
                        help="timed training steps per arm, after 5 untimed ones (at least 2)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, a few steps: checks the script itself (runs on CPU)")
    parser.add_argument("--compile-backend", default=None,
                        help="torch.compile backend of the torchao arms' layers (default "
                             "inductor; aot_eager with --smoke)")
    parser.add_argument("--out", help="also write the table (markdown) to this file")
    args = parser.parse_args(argv)
    if args.steps < 2:
        raise UserError(f"--steps {args.steps}: the check takes a median and a loss over the "
                        "last steps; use --steps 2 or more")
    if args.compile_backend is None:
        args.compile_backend = SMOKE["backend"] if args.smoke else "inductor"
    import torch._dynamo

    backends = torch._dynamo.list_backends(exclude_tags=())
    if args.compile_backend not in backends:
        raise UserError(f"--compile-backend {args.compile_backend}: torch.compile knows "
                        f"{', '.join(backends)}")
    return args


@exits_cleanly_on_user_error
def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from megatron_gnmr.gpu_check.groups import groups, run_group
    from megatron_gnmr.platform import capabilities, quiet_known_warnings

    quiet_known_warnings()
    if not capabilities.cuda() and not args.smoke:
        raise UserError(f"gpu_check needs a GPU ({capabilities.cuda().reason}); --smoke runs "
                        "the script's CPU path")
    steps, warmup, work_steps = (SMOKE["steps"], SMOKE["warmup"], SMOKE["work_steps"]) \
        if args.smoke else (args.steps, WARMUP, WORK_STEPS)
    model = SMOKE_MODEL if args.smoke else GPU_MODEL
    reference = "bf16" if "--bf16" in model else "fp32"
    started = time.perf_counter()
    rows = capability_rows()
    base = base_flags(model, steps, warmup, work_steps)
    for group in groups(base, reference, args.compile_backend):
        rows += run_group(group, steps, warmup, work_steps, judge=not args.smoke)
    rows += rows_or_cannot_run([("checkpoint", "save -> resume")],
                               lambda: checkpoint_rows(args.smoke))
    words = SMOKE_MODEL_WORDS if args.smoke else GPU_MODEL_WORDS
    notes = [f"Model: {words}. Each group's arms trained side by side from one seed: "
             f"{warmup} untimed steps, {steps} timed (median step), {work_steps} with the step "
             f"component timed; the torchao arms' layers compiled with "
             f"torch.compile(backend={args.compile_backend!r}), the te arms eager. "
             f"{time.perf_counter() - started:.0f} s in all."]
    ok, table = render("GPU check" + (" (CPU smoke run)" if args.smoke else ""), notes, rows)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
