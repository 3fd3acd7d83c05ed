"""The DeepSeek family: multi-latent attention (MLA, DeepSeek-V2/V3), megatron's
`MLASelfAttention`.

Queries come from d_model directly (`linear_q_proj`, DeepSeek-V2-Lite) or through a
compressed latent (`linear_q_down_proj` -> RMSNorm -> `linear_q_up_proj`, V2/V3 with
`--q-lora-rank`); keys and values share one latent per token (`linear_kv_down_proj` ->
RMSNorm -> `linear_kv_up_proj`), plus a decoupled RoPE key of `--qk-pos-emb-head-dim` taken
from the same down projection and shared by every head. Each head's query and key are
[content (qk_head_dim) | position (qk_pos_emb_head_dim)]; its value is v_head_dim wide.
Units per layer, in canonical order: the query linear(s), `linear_kv_down_proj`,
`linear_kv_up_proj`, then `linear_proj` (v_head_dim x heads -> d_model). All four or five
are column-parallel but the output projection, and megatron gathers the down projections'
split outputs before their norms.

What the attention monitor reads (SPEC 7.1) for MLA: the QK product of head h is the
bilinear form x A_h B_h^T x'^T with A_h = [W_q,content^h | W_q,rope^h] and B_h = [W_kv_up,k^h
diag(g_kv) W_kv_down,latent | W_kv_down,rope] (d_model x (qk_head_dim + rope)), the latent
norms' weights included and their per-token 1/rms left out (a positive scale per token, as
the layer's input norm is left out for LLaMA; with --q-lora-rank the query goes through
W_q,up diag(g_q) W_q,down the same way). RoPE's rotation is left out in both families
(megatron's MLA also reorders the RoPE dimensions, evens then odds, in query and key alike,
which leaves the product unchanged). So D2 =
dA B^T + A dB^T is the first-order change of that form: a content part that moves through
the latent (the up and down projections compose, so their increments are taken of the
composed maps, not of each weight), and a position part of rank at most qk_pos_emb_head_dim
whose key side is one matrix shared by all heads: a collapse in the decoupled RoPE key shows
in every head's D2 at once. H(dW_q) is the spectrum of the stacked query maps' increment,
H(dW_k) of the stacked content keys plus the shared RoPE key once.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_gnmr.errors import UserError
from megatron_gnmr.model_families.base import (
    QueryKeyMaps,
    UnitLinear,
    gather_rows,
)
from megatron_gnmr.limits import check_limits, limit
from megatron_gnmr.model_families.deepseek_mla_hf import DEEPSEEK_V3_HF
from megatron_gnmr.platform import megatron_compat

Q, Q_DOWN, Q_UP = "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj"
KV_DOWN, KV_UP, PROJ = "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"
# megatron's MLA constructor accepts its down projections only from a fixed list of classes
# (`submodules.linear_kv_down_proj in [...]`, an equality test: a subclass is refused).
DOWN_PROJECTIONS = (Q_DOWN, KV_DOWN)


@dataclass
class MLAConfig:
    """The mla section: multi-latent attention's widths (`--model-family deepseek-mla`),
    megatron's names; defaults are DeepSeek-V2-Lite's."""

    q_lora_rank: Optional[int] = limit(None, ge=1)
    """MLA: the query latent's width (None: queries straight from d_model, as V2-Lite;
    DeepSeek-V3: 1536)."""
    kv_lora_rank: int = limit(32, ge=1)
    """MLA: the key/value latent's width, what a KV cache holds per token (Megatron-LM's
    default 32; DeepSeek-V3: 512)."""
    qk_head_dim: int = limit(128, ge=1)
    """MLA: each head's query/key content width."""
    qk_pos_emb_head_dim: int = limit(64, ge=2)
    """MLA: the decoupled RoPE part of each query and of the key shared by all heads."""
    v_head_dim: int = limit(128, ge=1)
    """MLA: each head's value width."""
    rotary_scaling_factor: float = limit(1.0, ge=1)
    """MLA: YaRN's context extension of the decoupled RoPE by this factor (DeepSeek-V3: 40,
    megatron-core's YaRN); 1: plain RoPE."""
    mscale: float = limit(1.0, gt=0)
    """MLA, YaRN: the attention-scale's mscale (DeepSeek-V3: 1.0)."""
    mscale_all_dim: float = limit(0.0, ge=0)
    """MLA, YaRN: mscale over all dimensions (DeepSeek-V3: 1.0)."""
    yarn_beta_fast: Optional[float] = limit(None, gt=0)
    """MLA, YaRN: the fast correction bound (None: megatron-core's, 32)."""
    yarn_beta_slow: Optional[float] = limit(None, gt=0)
    """MLA, YaRN: the slow correction bound (None: megatron-core's, 1)."""
    yarn_original_max_position_embeddings: Optional[int] = limit(None, ge=1)
    """MLA, YaRN: the context length the RoPE was trained for (None: megatron-core's, 4096)."""

    def __post_init__(self) -> None:
        check_limits(self, "mla")


def _rope(s: MLAConfig) -> dict:
    """The decoupled RoPE: plain, or YaRN (megatron-core's) with a scaling factor above 1 (a
    context extension, as DeepSeek-V3 trains; megatron-core's MLA default is YaRN at 40, ours
    plain RoPE unless asked)."""
    if s.rotary_scaling_factor == 1.0:
        return {"rope_type": "rope", "rotary_scaling_factor": 1.0}
    optional = {"beta_fast": s.yarn_beta_fast, "beta_slow": s.yarn_beta_slow,
                "original_max_position_embeddings": s.yarn_original_max_position_embeddings}
    return {"rope_type": "yarn", "rotary_scaling_factor": s.rotary_scaling_factor,
            "mscale": s.mscale, "mscale_all_dim": s.mscale_all_dim,
            **{k: v for k, v in optional.items() if v is not None}}


class DeepSeekMLA:
    name = "deepseek-mla"
    hf = DEEPSEEK_V3_HF  # transformers' DeepseekV3ForCausalLM, both ways
    settings_section = "mla"

    def attention_linears(self, config) -> tuple[UnitLinear, ...]:
        m, s = config.model, config.mla
        heads, d = m.num_attention_heads, m.hidden_size
        query_width = heads * (s.qk_head_dim + s.qk_pos_emb_head_dim)
        queries = (UnitLinear(Q, "column", d, query_width),) if s.q_lora_rank is None else (
            UnitLinear(Q_DOWN, "column", d, s.q_lora_rank),
            UnitLinear(Q_UP, "column", s.q_lora_rank, query_width))
        return (*queries,
                UnitLinear(KV_DOWN, "column", d, s.kv_lora_rank + s.qk_pos_emb_head_dim),
                UnitLinear(KV_UP, "column", s.kv_lora_rank,
                           heads * (s.qk_head_dim + s.v_head_dim)),
                UnitLinear(PROJ, "row", heads * s.v_head_dim, d))

    def head_widths(self, config) -> tuple[int, int]:
        s = config.mla
        return s.qk_head_dim + s.qk_pos_emb_head_dim, s.v_head_dim

    def check(self, config) -> None:
        m, s, tp = config.model, config.mla, config.parallel.tensor_model_parallel_size
        if m.use_rope_scaling:
            raise UserError("--use-rope-scaling is Llama 3's scaling of plain RoPE; multi-latent "
                            "attention's decoupled RoPE scales with YaRN "
                            "(--rotary-scaling-factor)")
        if m.num_query_groups not in (None, m.num_attention_heads):
            raise UserError(f"--num-query-groups {m.num_query_groups}: multi-latent attention "
                            "has one key per head (its keys share a latent instead); leave it "
                            "unset with --model-family deepseek-mla")
        if s.qk_pos_emb_head_dim % 2:
            raise UserError(f"--qk-pos-emb-head-dim {s.qk_pos_emb_head_dim}: RoPE needs an "
                            "even width")
        split = {"--num-attention-heads": m.num_attention_heads,
                 "--kv-lora-rank + --qk-pos-emb-head-dim": s.kv_lora_rank + s.qk_pos_emb_head_dim}
        if s.q_lora_rank is not None:
            split["--q-lora-rank"] = s.q_lora_rank
        for flag, value in split.items():
            if value % tp:
                raise UserError(f"--tensor-model-parallel-size {tp} must divide {flag} "
                                f"({value}): multi-latent attention splits it over TP")

    def transformer_config(self, config) -> tuple[type, dict]:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        s = config.mla
        return MLATransformerConfig, {
            "multi_latent_attention": True, "num_query_groups": config.model.num_attention_heads,
            "q_lora_rank": s.q_lora_rank, "kv_lora_rank": s.kv_lora_rank,
            "qk_head_dim": s.qk_head_dim, "qk_pos_emb_head_dim": s.qk_pos_emb_head_dim,
            "v_head_dim": s.v_head_dim, "qk_layernorm": _latent_norms(config),
            **_rope(s)}

    # megatron's local `DotProductAttention` takes no separate key and value widths: the
    # model builder gives the local MLA layer the emulated flash attention as its core
    # attention (exact unless a low-precision attention is asked for)
    needs_emulated_core_attention = True

    def local_layer_spec(self, config, num_experts: int | None):
        """megatron's local MLA layer (its core attention: see above)."""
        spec = megatron_compat.local_layer_spec(num_experts, multi_latent_attention=True,
                                                qk_layernorm=_latent_norms(config))
        return _with_routable_attention(spec)

    def te_layer_spec(self, config, num_experts: int | None):
        return _with_routable_attention(megatron_compat.te_layer_spec(
            num_experts, multi_latent_attention=True, qk_layernorm=_latent_norms(config)))

    def route_attention_linears(self, spec, route):
        linears = {name: getattr(megatron_compat.attention_submodules(spec), name)
                   for name in (Q, Q_DOWN, Q_UP, KV_DOWN, KV_UP, PROJ)}
        routed = {name: route(cls) for name, cls in linears.items() if cls is not None}
        spec = megatron_compat.replace_attention_linears(
            spec, {name: cls for name, cls in routed.items() if name not in DOWN_PROJECTIONS})
        node = megatron_compat.submodules_of(spec).self_attention
        node.params = {**node.params, "down_projections": {
            name: cls for name, cls in routed.items() if name in DOWN_PROJECTIONS}}
        return spec

    def attention_linear_classes(self, spec) -> dict[str, type]:
        node = megatron_compat.submodules_of(spec).self_attention
        routed_down = node.params.get("down_projections", {})
        return {name: routed_down.get(name, getattr(node.submodules, name))
                for name in (Q, Q_DOWN, Q_UP, KV_DOWN, KV_UP, PROJ)}

    def attention_weights(self, attention) -> dict[str, torch.Tensor]:
        names = {"q": Q, "q_down": Q_DOWN, "q_up": Q_UP, "kv_down": KV_DOWN, "kv_up": KV_UP}
        weights = {key: getattr(attention, name).weight for key, name in names.items()
                   if hasattr(attention, name)}
        for key, norm in (("q_norm", "q_layernorm"), ("kv_norm", "kv_layernorm")):
            weight = getattr(getattr(attention, norm, None), "weight", None)
            if weight is not None:
                weights[key] = weight
        return {key: tensor.detach().float().clone() for key, tensor in weights.items()}

    def query_key_maps(self, weights, attention, tp_group) -> QueryKeyMaps:
        c = attention.config
        w = {key: tensor.double() for key, tensor in weights.items()}
        d_model = w["kv_down"].shape[1]
        query_rows = w["q"] if "q" in w else \
            w["q_up"] @ _normed(gather_rows(w["q_down"], tp_group), w.get("q_norm"))
        heads = query_rows.shape[0] // (c.qk_head_dim + c.qk_pos_emb_head_dim)
        kv_down = gather_rows(w["kv_down"], tp_group)
        latent = _normed(kv_down[:c.kv_lora_rank], w.get("kv_norm"))
        rope_key = kv_down[c.kv_lora_rank:]  # [rope, d_model], shared by every head
        kv_up = w["kv_up"].reshape(heads, c.qk_head_dim + c.v_head_dim, c.kv_lora_rank)
        content_keys = kv_up[:, :c.qk_head_dim] @ latent  # [heads, qk_head_dim, d_model]
        keys = torch.cat([content_keys, rope_key.expand(heads, -1, -1)], dim=1)
        first_rank = tp_group is None or torch.distributed.get_rank(tp_group) == 0
        key_rows = torch.cat([content_keys.reshape(-1, d_model)]
                             + ([rope_key] if first_rank else []))
        return QueryKeyMaps(
            queries=query_rows.reshape(heads, -1, d_model).transpose(1, 2),
            keys=keys.transpose(1, 2), group_of_head=torch.arange(heads),
            query_rows=query_rows, key_rows=key_rows)

    def upgrade_snapshot(self, snapshot) -> dict[str, torch.Tensor]:
        return snapshot


def _normed(rows: torch.Tensor, norm_weight: torch.Tensor | None) -> torch.Tensor:
    """A latent's rows scaled by its RMSNorm's weight (diag(g) W)."""
    return rows if norm_weight is None else norm_weight[:, None] * rows


def _latent_norms(config) -> bool:
    """DeepSeek normalises its latents (RMSNorm on the query latent and on the key/value
    latent). megatron's `qk_layernorm` builds both or neither, and without Transformer
    Engine's fused norm+linear (0.19's local spec has none) a key/value norm comes only
    with a query latent: so the latents are normalised with --q-lora-rank (V2, V3) and not
    without it (a V2-Lite-shaped model here has norm-free latents, on either release)."""
    return config.mla.q_lora_rank is not None


def _with_routable_attention(spec):
    spec = copy.deepcopy(spec)
    megatron_compat.submodules_of(spec).self_attention.module = routable_mla_attention()
    return spec


class SharedRopeKeyGradient(torch.autograd.Function):
    """Identity forward on MLA's key [..., heads, qk_head_dim + rope]; backward, the RoPE part's
    gradient summed over every head of the tensor-parallel group.

    The decoupled RoPE key is one tensor shared by all heads (expanded over them), so its
    gradient is the sum over all heads. megatron's MLA computes it from the gathered output of
    a column-parallel down projection, and that gather's backward only splits: each rank's
    share of the RoPE rows receives the gradient of its own heads alone (0.16.1 and 0.19.x,
    unless Transformer Engine's duplicated down projection runs with sequence parallelism,
    whose sequence gather reduce-scatters). Measured here: after 4 steps at TP=2 those rows
    were 1e-2 away from TP=1's, every other weight within 1e-4. Adding the other ranks' sum to
    one head's RoPE gradient makes the shared key's gradient the whole sum and leaves every
    other gradient as it was."""

    @staticmethod
    def forward(ctx, key, rope_width: int, group):
        ctx.rope_width, ctx.group = rope_width, group
        return key.view_as(key)

    @staticmethod
    def backward(ctx, grad):
        local = grad[..., -ctx.rope_width:].sum(dim=-2)  # what the shared key gets here
        total = local.clone()
        torch.distributed.all_reduce(total, group=ctx.group)
        grad = grad.clone()
        grad[..., 0, -ctx.rope_width:] += total - local
        return grad, None, None


@functools.lru_cache(maxsize=None)  # one class: specs are compared and deep-copied
def routable_mla_attention() -> type:
    """megatron's MLASelfAttention with two changes. Its down projections can be
    path-routed: it builds them from megatron's class (the only ones its constructor
    accepts), then narrows each to the routed subclass the spec names (`down_projections`: a
    subclass that adds no state, only a forward that asks the unit's path). And the shared
    RoPE key's gradient is whole under tensor parallelism (`SharedRopeKeyGradient`). Defined
    on first use: a config reads this module without importing megatron."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class RoutableMLASelfAttention(MLASelfAttention):
        def __init__(self, *args, down_projections: dict[str, type] | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            if not self.config.sequence_parallel:
                # Each TP rank normalises the whole gathered latent, so its norm weights'
                # gradients are whole already; megatron sums every `*q_layernorm*` /
                # `*k_layernorm*` gradient over TP under qk_layernorm (right for per-head
                # norms, TP times too much here). Averaged, they stay whole.
                for norm in (getattr(self, "q_layernorm", None), self.kv_layernorm):
                    weight = getattr(norm, "weight", None)
                    if weight is not None:
                        weight.average_gradients_across_tp_domain = True
            for name, routed in (down_projections or {}).items():
                module = getattr(self, name, None)
                if module is not None and type(module) is not routed:
                    if not issubclass(routed, type(module)):
                        raise TypeError(f"{name}: {routed.__name__} does not extend "
                                        f"{type(module).__name__}")
                    module.__class__ = routed

        def get_query_key_value_tensors(self, *args, **kwargs):
            query, key, *rest = super().get_query_key_value_tensors(*args, **kwargs)
            if key.requires_grad and self._rope_key_gradient_is_partial():
                key = SharedRopeKeyGradient.apply(key, self.config.qk_pos_emb_head_dim,
                                                  self.tp_group)
            return (query, key, *rest)

        def _rope_key_gradient_is_partial(self) -> bool:
            if torch.distributed.get_world_size(self.tp_group) == 1:
                return False
            split = isinstance(self.linear_kv_down_proj, ColumnParallelLinear)
            return split or not self.config.sequence_parallel

    return RoutableMLASelfAttention


DEEPSEEK_MLA = DeepSeekMLA()
