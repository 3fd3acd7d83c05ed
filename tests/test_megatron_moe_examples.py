"""Megatron-LM's MoE command lines given to pretrain_llama.py as written but for the sizes,
shrunk to a CPU world of one: `examples/mixtral/train_mixtral_8x7b_distributed.sh` and the
DeepSeek-V3 line of `examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh` (read at
Megatron-LM's main of 2026-12, d98e8a64). Each line as written is refused in one line naming
exactly the flags megatron-gnmr does not have, each with its reason; without them it trains,
with its MoE and router flags reaching megatron-core's config (group-limited routing, the
routed scaling factor, the router's dtype, YaRN on the decoupled RoPE) and its logging flags
logging (the parameters' norm, the zero gradients)."""

import json
import re
from pathlib import Path

import pytest

from megatron_gnmr.arguments import parse_config
from tests.helpers import pretrain_in_process, read_jsonl, train_losses

# Mixtral 8x7B: MODEL_ARGS, MOE_ARGS, TRAINING_ARGS, MODEL_PARALLEL_ARGS, LOGGING_ARGS;
# 32 layers of 4096 -> 2 of 64, 8 experts of 14336 -> 4 of 96, PP 4 / EP 8 -> 1, its
# tokenizer and data -> mock data
MIXTRAL = [
    "--use-mcore-models", "--disable-bias-linear", "--seq-length", "64",
    "--max-position-embeddings", "256", "--num-layers", "2", "--hidden-size", "64",
    "--ffn-hidden-size", "96", "--num-attention-heads", "4", "--init-method-std", "0.01",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--swiglu", "--untie-embeddings-and-output-weights",
    "--group-query-attention", "--num-query-groups", "2", "--no-masked-softmax-fusion",
    "--no-position-embedding", "--rotary-base", "1000000",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type",
    "aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm",
    "--moe-token-dispatcher-type", "alltoall", "--overlap-param-gather",
    "--overlap-grad-reduce",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-4", "--train-iters", "4",
    "--lr-decay-iters", "3", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5",
    "--weight-decay", "0.1", "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--bf16",
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
    "--expert-model-parallel-size", "1", "--use-distributed-optimizer", "--sequence-parallel",
    "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000",
    "--eval-iters", "1", "--no-load-optim", "--no-load-rng",
]
MIXTRAL_REFUSED = {"--moe-grouped-gemm"}

# DeepSeek-V3: 61 layers of 7168 -> 4 of 64 (the first dense), 256 experts -> 8 in 4 groups
# (topk 8 of 4 groups of 8 -> 2 of 2 groups), MLA's widths shrunk, its tokenizer -> mock data
DEEPSEEK_V3 = """--distributed-timeout-minutes 60 --tensor-model-parallel-size 1
--expert-model-parallel-size 1 --expert-tensor-parallel-size 1 --context-parallel-size 1
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --use-mcore-models
--sequence-parallel --use-flash-attn --disable-bias-linear --micro-batch-size 2
--global-batch-size 4 --train-samples 16 --exit-duration-in-mins 220
--no-check-for-nan-in-loss-and-grad --manual-gc --manual-gc-interval 10
--recompute-granularity selective --recompute-modules mlp moe mla_up_proj layernorm
--transformer-impl transformer_engine --seq-length 64 --no-mmap-bin-files
--no-create-attention-mask-in-dataloader --num-workers 1 --num-layers 4 --hidden-size 64
--ffn-hidden-size 128 --num-attention-heads 4 --kv-channels 16
--max-position-embeddings 64 --position-embedding-type rope --rotary-base 10000
--make-vocab-size-divisible-by 3232 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
--untie-embeddings-and-output-weights --multi-latent-attention --attention-dropout 0.0
--hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --qk-layernorm
--lr-decay-samples 12 --lr-warmup-samples 4 --lr-warmup-init 3.9e-7 --lr 3.9e-4
--min-lr 3.9e-5 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --num-experts 8
--moe-layer-freq [0]*1+[1]*3 --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32
--moe-router-load-balancing-type seq_aux_loss --moe-router-topk 2
--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep
--moe-router-pre-softmax --moe-grouped-gemm --moe-aux-loss-coeff 1e-4
--moe-router-group-topk 2 --moe-router-num-groups 4 --moe-router-topk-scaling-factor 2.5
--moe-router-score-function sigmoid --moe-router-enable-expert-bias
--moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --moe-permute-fusion
--moe-router-force-load-balancing --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16
--qk-pos-emb-head-dim 8 --v-head-dim 16 --rotary-scaling-factor 40 --mscale 1.0
--mscale-all-dim 1.0 --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 --eval-iters 1
--eval-interval 100 --auto-detect-ckpt-format --save-interval 100
--dist-ckpt-strictness log_all --init-method-std 0.02 --log-timers-to-tensorboard
--log-memory-to-tensorboard --log-num-zeros-in-grad --log-params-norm
--log-validation-ppl-to-tensorboard --log-throughput --log-interval 1 --logging-level 40
--bf16 --enable-experimental""".split()
DEEPSEEK_V3_REFUSED = {
    "--recompute-modules", "--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend",
    "--moe-grouped-gemm", "--moe-router-force-load-balancing", "--mtp-num-layers",
    "--mtp-loss-scaling-factor", "--dist-ckpt-strictness", "--log-timers-to-tensorboard",
    "--log-memory-to-tensorboard", "--logging-level", "--enable-experimental"}


def _common(tmp_path: Path) -> list[str]:
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
            "--data-cache-path", str(tmp_path / "cache"), "--split", "99,1,0",
            "--save", str(tmp_path / "run"), "--load", str(tmp_path / "run"),
            "--tensorboard-dir", str(tmp_path / "tensorboard")]


def _without(line: list[str], flags: set[str]) -> list[str]:
    """The line without `flags` and their values (the words up to the next flag)."""
    out, dropping = [], False
    for word in line:
        if word.startswith("--"):
            dropping = word in flags
        if not dropping:
            out.append(word)
    return out


@pytest.mark.parametrize("line,refused", [(MIXTRAL, MIXTRAL_REFUSED),
                                          (DEEPSEEK_V3, DEEPSEEK_V3_REFUSED)],
                         ids=["mixtral", "deepseek-v3"])
def test_the_line_as_written_is_refused_naming_what_is_missing(line, refused, tmp_path, capfd):
    assert pretrain_in_process([*line, *_common(tmp_path), "--transformer-impl", "local"]) == 2
    error = capfd.readouterr().err.strip().splitlines()
    assert len(error) == 1, error
    assert set(re.findall(r"(?:have: |; )(--[\w-]+)", error[0])) == refused
    assert not (tmp_path / "run").exists()


def test_the_mixtral_line_trains(tmp_path):
    args = [*_without(MIXTRAL, MIXTRAL_REFUSED), *_common(tmp_path), "--transformer-impl",
            "local"]
    assert pretrain_in_process(args) == 0
    assert max(train_losses(tmp_path / "run")) == 4
    model = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert (model["num_experts"], model["moe_router_topk"]) == (4, 2)


def test_the_deepseek_v3_line_trains_with_its_router_and_yarn(tmp_path):
    from megatron_gnmr.model import transformer_config

    args = [*_without(DEEPSEEK_V3, DEEPSEEK_V3_REFUSED), "--moe-token-dispatcher-type",
            "alltoall", *_common(tmp_path), "--transformer-impl", "local"]
    megatron = transformer_config(parse_config(args))
    assert (megatron.moe_router_num_groups, megatron.moe_router_group_topk,
            megatron.moe_router_topk_scaling_factor, megatron.moe_router_dtype,
            megatron.moe_router_pre_softmax, megatron.moe_router_score_function) == \
        (4, 2, 2.5, "fp32", True, "sigmoid")
    assert (megatron.rope_type, megatron.rotary_scaling_factor, megatron.mscale,
            megatron.mscale_all_dim) == ("yarn", 40.0, 1.0, 1.0)
    assert pretrain_in_process(args) == 0
    logged = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert len(logged) == 4
    # a count of elements: a whole number, some zero (the embedding rows of the tokens a
    # batch does not hold get no gradient), never all of them
    parameters = next(r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")
                      if r.get("event") == "start")["parameters_on_rank0"]
    zeros = [r["train/num_zeros_in_grad"] for r in logged]
    assert all(z == int(z) and 0 < z < parameters for z in zeros), (zeros, parameters)
    assert all(r["train/params_norm"] > 0 for r in logged)
    # the weights move each step, so their norm does too
    assert len({round(r["train/params_norm"], 9) for r in logged}) == len(logged)
