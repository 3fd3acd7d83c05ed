"""The GEMM shapes of every unit, per tensor-parallel shard, and the FP8 kernels' shape rules.

Real FP8 GEMMs refuse shapes that emulation happily runs, and they refuse them at the first
forward, minutes into a cluster job. The rules are checked before anything is built:

| backend | rule (per TP shard) | source |
|---|---|---|
| TE, current / block scaling | input [tokens, K]: tokens % 8, K % 16; weight [N, K]: N % 8 | TE `assert_dim_for_fp8_exec` (module/linear.py, layernorm_linear.py) |
| TE, MXFP8 | every dim % 32 | TE `mxfp8_scaling.cu` ("rows/cols must be divisible by 32") |
| `torch._scaled_mm` (torchao) | M, N, K % 16 for the forward, dgrad and wgrad GEMMs | aten `_scaled_mm` checks |

Expert GEMMs have a token count that changes every step; megatron pads it for FP8
(`SequentialMLP._pad_tensor_for_quantization`), so only their feature dims are checked.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UnitGemm:
    unit: str  # a unit kind: an attention linear, linear_fc1, linear_fc2 (or experts')
    tokens: int | None  # rows of the input; None for experts (padded by megatron)
    in_features: int  # K of this shard
    out_features: int  # N of this shard


def unit_gemms(config) -> list[UnitGemm]:
    """One entry per kind of unit GEMM of the model, as one tensor-parallel rank sees it."""
    from megatron_gnmr.model_families import family_of

    m, tp = config.model, config.parallel.tensor_model_parallel_size
    tokens = config.training.micro_batch_size * m.seq_length
    gemms = [UnitGemm(linear.name, tokens,
                      linear.in_features // (tp if linear.parallel == "row" else 1),
                      linear.out_features // (tp if linear.parallel == "column" else 1))
             for linear in family_of(config).attention_linears(config)]
    dense = [UnitGemm("linear_fc1", tokens, m.hidden_size, 2 * m.ffn_hidden_size // tp),
             UnitGemm("linear_fc2", tokens, m.ffn_hidden_size // tp, m.hidden_size)]
    if m.num_experts:
        if m.moe_first_dense_layers:
            gemms += dense
        # Routed experts see a varying number of tokens (None: not checked); megatron splits
        # them over the expert tensor-parallel group (the TP group by default).
        expert = m.moe_ffn_hidden_size or m.ffn_hidden_size
        gemms += [UnitGemm("experts.linear_fc1", None, m.hidden_size, 2 * expert // tp),
                  UnitGemm("experts.linear_fc2", None, expert // tp, m.hidden_size)]
        shared = m.moe_shared_expert_intermediate_size
        if shared:
            gemms += [UnitGemm("shared_experts.linear_fc1", tokens, m.hidden_size,
                               2 * shared // tp),
                      UnitGemm("shared_experts.linear_fc2", tokens, shared // tp, m.hidden_size)]
        return gemms
    return gemms + dense


def shape_problems(gemms: list[UnitGemm], tokens_multiple: int, features_multiple: int,
                   out_multiple: int) -> list[str]:
    """Each unit GEMM dimension that breaks a rule, as `unit: name = value (not a multiple
    of k)`."""
    problems = []
    for gemm in gemms:
        checks = [("tokens (micro-batch x sequence)", gemm.tokens, tokens_multiple),
                  ("K (input features per TP shard)", gemm.in_features, features_multiple),
                  ("N (output features per TP shard)", gemm.out_features, out_multiple)]
        for name, value, multiple in checks:
            if value is not None and value % multiple:
                problems.append(f"{gemm.unit}: {name} = {value} is not a multiple of {multiple}")
    return problems


def step_macs(config, world_size: int) -> int:
    """Multiply-accumulates of one optimizer step's unit GEMMs on one rank (forward, dgrad
    and wgrad; dense models: expert token counts vary), for a cost estimate."""
    data_parallel = world_size // (config.parallel.tensor_model_parallel_size
                                   * config.parallel.pipeline_model_parallel_size)
    t = config.training
    micro_batches = t.global_batch_size // (t.micro_batch_size * max(data_parallel, 1))
    layers = config.model.num_layers // config.parallel.pipeline_model_parallel_size
    per_micro_batch = sum(3 * g.tokens * g.in_features * g.out_features
                          for g in unit_gemms(config) if g.tokens is not None)
    return per_micro_batch * layers * micro_batches
