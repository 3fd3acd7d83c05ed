"""Megatron-LM's Llama-3 8B FP8 example (`examples/llama/train_llama3_8b_h100_fp8.sh`, the
argument arrays as that script builds them, read at Megatron-LM core_v0.16.1) given to
pretrain_llama.py unchanged but for the sizes, shrunk to the CPU, its mock data, and
`--transformer-impl local` (no Transformer Engine here). With DTYPE other than fp8 it trains:
the samples-based cosine schedule ends at --min-lr, the checkpoint is torch_dist where --save
says, TensorBoard logs where --tensorboard-dir says. With DTYPE=fp8 the flags of delayed
scaling and FP8 parameters, which megatron-gnmr does not have, are refused in one line, each
with its reason."""

import math
from pathlib import Path

import pytest
import torch

from tests.helpers import pretrain_in_process, read_jsonl, train_losses

# The script's arrays; sizes shrunk (8B -> 2 layers of 64; 8192 tokens -> 64; 128 sequences
# -> 8; the sample counts to six steps), everything else as written.
MODEL_ARGS = [
    "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64",
    "--ffn-hidden-size", "176", "--num-attention-heads", "4", "--group-query-attention",
    "--num-query-groups", "2", "--kv-channels", "16", "--seq-length", "64",
    "--max-position-embeddings", "64", "--position-embedding-type", "rope",
    "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0", "--swiglu", "--normalization", "RMSNorm",
    "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
]
TRAINING_ARGS = [
    "--micro-batch-size", "4", "--global-batch-size", "8", "--train-samples", "48",
    "--lr-decay-samples", "40", "--lr-warmup-samples", "8", "--lr", "0.00015",
    "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
    "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
    "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
    "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
    # DDP_ARGS, appended to TRAINING_ARGS by the script
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
]
FP8_ARGS = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
            "--fp8-amax-compute-algo", "max", "--fp8-param-gather"]
MODEL_PARALLEL_ARGS = ["--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
                       "--sequence-parallel"]


def data_args(cache: Path) -> list[str]:
    # the script writes "--split '99,1,0'", whose quotes bash passes on literally; the value
    # the script means is 99,1,0
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
            "--data-cache-path", str(cache), "--tiktoken-pattern", "v2", "--split", "99,1,0",
            "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files",
            "--num-workers", "1"]


def eval_and_logging_args(checkpoints: Path, tensorboard: Path) -> list[str]:
    return ["--log-interval", "1", "--eval-iters", "1", "--eval-interval", "100",
            "--save-interval", "1000", "--log-throughput", "--profile",
            "--profile-step-start", "2", "--profile-step-end", "3", "--ckpt-format",
            "torch_dist", "--distributed-timeout-minutes", "60", "--save", str(checkpoints),
            "--load", str(checkpoints), "--tensorboard-dir", str(tensorboard)]


def command(tmp_path: Path, fp8: bool) -> list[str]:
    return [*MODEL_ARGS, *TRAINING_ARGS, *(FP8_ARGS if fp8 else []), *MODEL_PARALLEL_ARGS,
            *data_args(tmp_path / "cache"),
            *eval_and_logging_args(tmp_path / "checkpoints", tmp_path / "tensorboard"),
            "--transformer-impl", "local"]


def test_the_llama3_example_trains_with_dtype_bf16(tmp_path):
    run = tmp_path / "checkpoints"
    assert pretrain_in_process(command(tmp_path, fp8=False)) == 0
    assert sorted(train_losses(run)) == list(range(1, 7))  # 48 samples / 8 per step
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "train/lr" in r]
    lrs = {r["step"]: r["train/lr"] for r in rows}
    assert lrs[1] == 0.00015 and lrs[6] == 0.00001  # warmup 1 step, cosine to --min-lr
    # the embedding and output layer on their own schedule, --decoupled-lr to its minimum
    decoupled = {r["step"]: r["train/decoupled_lr"] for r in rows}
    assert decoupled[1] == 5.0e-4 and decoupled[6] == 4.5e-5
    # Megatron's cosine by hand, in samples: step s has seen 8 s samples; warm-up to 8, decay
    # to 40: at step s the coefficient is (1 + cos(pi (8 s - 8) / 32)) / 2, for both schedules
    for step in (2, 3, 4):
        coefficient = (1 + math.cos(math.pi * (8 * step - 8) / 32)) / 2
        assert lrs[step] == pytest.approx(1e-5 + coefficient * (1.5e-4 - 1e-5), rel=1e-6)
        assert decoupled[step] == pytest.approx(4.5e-5 + coefficient * (5e-4 - 4.5e-5),
                                                rel=1e-6)
    # --bf16: the weights the run trained and saved are bfloat16 (the Adam state float32)
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(run / "iter_0000006")).read_metadata().state_dict_metadata
    weights = {k: v.properties.dtype for k, v in saved.items() if k.endswith(".weight")}
    assert len(weights) >= 6 and set(weights.values()) == {torch.bfloat16}, weights
    assert {v.properties.dtype for k, v in saved.items() if k.endswith(".exp_avg")} == \
        {torch.float32}
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert (run / "iter_0000006" / ".metadata").is_file()
    assert any((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))


def test_the_llama3_example_with_dtype_fp8_is_refused_naming_each_flag(tmp_path, capfd):
    capfd.readouterr()
    assert pretrain_in_process(command(tmp_path, fp8=True)) == 2
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err[-2000:]
    for flag, reason in (("--fp8-amax-history-len 1024", "delayed scaling"),
                         ("--fp8-amax-compute-algo max", "current scaling"),
                         ("--fp8-param-gather", "FP8 master weights")):
        assert flag in errors[0] and reason in errors[0]
    assert not (tmp_path / "checkpoints").exists()  # refused before anything was written
