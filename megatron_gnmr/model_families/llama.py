"""The LLaMA family: grouped-query attention with one fused QKV projection and RoPE.

Units per layer: `self_attention.linear_qkv` (column-parallel, d_model -> (heads + 2 groups)
x d_head) and `self_attention.linear_proj` (row-parallel, heads x d_head -> d_model), then the
SwiGLU MLP's. The fused QKV weight is interleaved per query group (`llama_layout.py`). Under
TP each rank holds `num_query_groups / tp` whole groups, so its query heads and their key
heads are local: GQA pairing never crosses ranks. Its Hugging Face mapping: `llama_hf.py`.
"""

from __future__ import annotations

import torch

from megatron_gnmr.errors import UserError
from megatron_gnmr.model_families.base import QueryKeyMaps, UnitLinear
from megatron_gnmr.model_families.llama_hf import LLAMA_HF
from megatron_gnmr.model_families.llama_layout import ATTENTION_LINEARS, PROJ, QKV, head_dim
from megatron_gnmr.platform import megatron_compat

class Llama:
    name = "llama"

    hf = LLAMA_HF  # Llama, Mistral and Mixtral's transformers classes, both ways

    def attention_linears(self, config) -> tuple[UnitLinear, ...]:
        m = config.model
        d_head = head_dim(m)
        groups = m.num_query_groups or m.num_attention_heads
        return (UnitLinear(QKV, "column", m.hidden_size,
                           (m.num_attention_heads + 2 * groups) * d_head),
                UnitLinear(PROJ, "row", m.num_attention_heads * d_head, m.hidden_size))

    def head_widths(self, config) -> tuple[int, int]:
        d_head = head_dim(config.model)
        return d_head, d_head

    def check(self, config) -> None:
        m, tp = config.model, config.parallel.tensor_model_parallel_size
        if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
            raise UserError(f"--hidden-size {m.hidden_size} must be divisible by "
                            f"--num-attention-heads {m.num_attention_heads} (or give the head "
                            "width with --kv-channels)")
        if head_dim(m) % 2:
            raise UserError(f"head dimension {head_dim(m)} (--kv-channels, else --hidden-size / "
                            "--num-attention-heads): RoPE needs an even one")
        groups = m.num_query_groups or m.num_attention_heads
        if m.num_attention_heads % groups:
            raise UserError(f"--num-attention-heads {m.num_attention_heads} must be divisible "
                            f"by --num-query-groups {groups}")
        if m.num_attention_heads % tp or groups % tp:
            raise UserError(
                f"--tensor-model-parallel-size {tp} must divide --num-attention-heads "
                f"{m.num_attention_heads} and --num-query-groups {groups}; pick a TP size "
                "that does")

    def transformer_config(self, config) -> tuple[type, dict]:
        from megatron.core.transformer import TransformerConfig

        m = config.model
        return TransformerConfig, {"num_query_groups": m.num_query_groups or m.num_attention_heads,
                                   "kv_channels": head_dim(m)}

    def local_layer_spec(self, config, num_experts: int | None):
        return megatron_compat.local_layer_spec(num_experts)

    def te_layer_spec(self, config, num_experts: int | None):
        return megatron_compat.te_layer_spec(num_experts)

    def route_attention_linears(self, spec, route):
        attention = megatron_compat.attention_submodules(spec)
        return megatron_compat.replace_attention_linears(
            spec, {name: route(getattr(attention, name)) for name in (QKV, PROJ)})

    def attention_linear_classes(self, spec) -> dict[str, type]:
        attention = megatron_compat.attention_submodules(spec)
        return {name: getattr(attention, name) for name in ATTENTION_LINEARS}

    def attention_weights(self, attention) -> dict[str, torch.Tensor]:
        return {QKV: getattr(attention, QKV).weight.detach().float().clone()}

    def query_key_maps(self, weights, attention, tp_group) -> QueryKeyMaps:
        config = attention.config
        heads_per_group = config.num_attention_heads // config.num_query_groups
        queries, keys, group_of_head = split_qkv(weights[QKV].double(), heads_per_group,
                                                 config.kv_channels)
        return QueryKeyMaps(queries, keys, group_of_head, stacked_rows(queries),
                            stacked_rows(keys))

    def upgrade_snapshot(self, snapshot) -> dict[str, torch.Tensor]:
        """A monitor snapshot from a checkpoint written before families (the fused QKV
        weight alone) in today's form."""
        return {QKV: snapshot} if torch.is_tensor(snapshot) else snapshot


def split_qkv(weight: torch.Tensor, heads_per_group: int, d_head: int):
    """(queries [local heads, d_model, d_head], keys [local groups, d_model, d_head],
    group_of_head [local heads]) out of a fused QKV weight, in SPEC 7.1's orientation (the
    map from the residual stream to the head)."""
    rows_per_group = (heads_per_group + 2) * d_head
    if weight.shape[0] % rows_per_group:
        raise ValueError(f"QKV weight with {weight.shape[0]} rows is not a multiple of "
                         f"(heads_per_group + 2) * d_head = {rows_per_group}")
    groups = weight.shape[0] // rows_per_group
    per_group = weight.reshape(groups, heads_per_group + 2, d_head, weight.shape[1])
    queries = per_group[:, :heads_per_group].reshape(-1, d_head, weight.shape[1])
    keys = per_group[:, heads_per_group]
    group_of_head = torch.arange(groups).repeat_interleave(heads_per_group)
    return queries.transpose(1, 2), keys.transpose(1, 2), group_of_head


def stacked_rows(maps: torch.Tensor) -> torch.Tensor:
    """[heads, d_model, d] maps -> the [heads * d, d_model] rows of the stacked linear weight."""
    return maps.transpose(1, 2).reshape(-1, maps.shape[1])


LLAMA = Llama()
