"""The DeepSeek family's Hugging Face mapping: transformers' `DeepseekV3ForCausalLM` both ways,
as pure functions of full (unsharded) state dicts and config dicts.

MLA's projections map one to one: `q_a_proj`/`q_a_layernorm`/`q_b_proj` (or `q_proj` without
a query latent) are megatron's `linear_q_down_proj`/`q_layernorm`/`linear_q_up_proj` (or
`linear_q_proj`); `kv_a_proj_with_mqa` is `linear_kv_down_proj` ([latent | RoPE key] rows in
both), `kv_a_layernorm` is `kv_layernorm`, `kv_b_proj` is `linear_kv_up_proj` (per head
[content key | value] in both), `o_proj` is `linear_proj`; each head's query is [content |
RoPE] in both. RoPE needs no permutation: megatron's MLA takes a head's RoPE dimensions evens
then odds before rotating halves, which is transformers' `rope_interleave` (every DeepSeek-V3
config has it; one without is refused). YaRN is megatron-core's with the same bands.

The MoE layers: `gate.weight` is the router's, `gate.e_score_correction_bias` megatron's
`expert_bias`; routed experts `experts.i.{gate,up,down}_proj` are `local_experts.i`'s fc1
[gate; up] and fc2; `shared_experts` is `shared_experts` (n_shared_experts x
moe_intermediate_size wide). transformers routes by sigmoid scores plus the bias, keeps the
best `topk_group` groups by the sum of each group's top 2, renormalises the top-k scores and
multiplies by `routed_scaling_factor`; megatron-core's group-limited top-k sums each group's
top topk / group_topk, so a run is exportable when that is 2 (DeepSeek-V3: 8 / 4). What the
class cannot express (softmax routing, no expert bias, a dense model) is refused by name.
The multi-token-prediction layers of a published checkpoint (`num_nextn_predict_layers`)
are not part of transformers' model either: import-hf leaves them out and says so.
"""

from __future__ import annotations

import torch

from megatron_gnmr.errors import UserError
from megatron_gnmr.model_families.tied_hf import (output_layer_from_hf, output_layer_to_hf,
                                                  tied, tied_head_on_disk)

ATTENTION = "self_attention."
EXPERTS = "mlp.experts.local_experts."
SHARED = "mlp.shared_experts."
# transformers' attention name -> megatron's (both `.weight`)
ATTENTION_NAMES = {"q_proj": "linear_q_proj", "q_a_proj": "linear_q_down_proj",
                   "q_a_layernorm": "q_layernorm", "q_b_proj": "linear_q_up_proj",
                   "kv_a_proj_with_mqa": "linear_kv_down_proj",
                   "kv_a_layernorm": "kv_layernorm", "kv_b_proj": "linear_kv_up_proj",
                   "o_proj": "linear_proj"}
GROUP_SCORE_TOP = 2  # transformers sums each group's top 2 scores to rank the groups
# transformers' latent norms (q_a_layernorm, kv_a_layernorm) keep their class default, 1e-6,
# whatever rms_norm_eps says; megatron-core's use the model's one epsilon
LATENT_NORM_EPS = 1e-6


def _attention_names(config) -> dict[str, str]:
    latent = config.mla.q_lora_rank is not None
    return {hf: ours for hf, ours in ATTENTION_NAMES.items()
            if hf != ("q_proj" if latent else "q_a_proj") and
            (latent or hf not in ("q_a_layernorm", "q_b_proj"))}


def _swiglu_to_hf(fc1: torch.Tensor, fc2: torch.Tensor, theirs: str) -> dict:
    gate, up = fc1.chunk(2, dim=0)
    return {theirs + "gate_proj.weight": gate, theirs + "up_proj.weight": up,
            theirs + "down_proj.weight": fc2}


def _swiglu_from_hf(weights: dict, theirs: str, ours: str) -> dict:
    return {ours + "linear_fc1.weight": torch.cat([weights[theirs + "gate_proj.weight"],
                                                    weights[theirs + "up_proj.weight"]]),
            ours + "linear_fc2.weight": weights[theirs + "down_proj.weight"]}


def _is_moe(config, layer: int) -> bool:
    return layer >= config.model.moe_first_dense_layers


def _rope_sections(rope: dict, where: str) -> dict:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return {}
    if kind != "yarn":
        raise UserError(f"{where}: rope type {kind!r} is not built by the deepseek-mla family "
                        "(plain RoPE, or YaRN)")
    optional = {"yarn_beta_fast": rope.get("beta_fast"), "yarn_beta_slow": rope.get("beta_slow"),
                "yarn_original_max_position_embeddings":
                    rope.get("original_max_position_embeddings")}
    return {"rotary_scaling_factor": float(rope["factor"]),
            "mscale": float(rope.get("mscale", 1.0)),
            "mscale_all_dim": float(rope.get("mscale_all_dim", 0.0)),
            **{k: (int(v) if k.endswith("embeddings") else float(v))
               for k, v in optional.items() if v is not None}}


class DeepSeekV3HF:
    """The deepseek-mla family's `family.hf`."""

    architectures = ("DeepseekV3ForCausalLM",)
    model_types = ("deepseek_v3",)
    projections = None  # no PEFT adapter export for this family yet

    def exportable(self, config, where: str) -> None:
        m = config.model
        refusals = [
            (not m.num_experts, "a dense deepseek-mla run: DeepseekV3ForCausalLM is a MoE model"),
            (m.moe_router_score_function != "sigmoid",
             f"--moe-router-score-function {m.moe_router_score_function}: "
             "DeepseekV3ForCausalLM routes by sigmoid scores"),
            (not m.moe_router_enable_expert_bias, "no --moe-router-enable-expert-bias: "
             "DeepseekV3ForCausalLM always routes with its e_score_correction_bias"),
            (m.moe_shared_expert_intermediate_size is None or
             m.moe_shared_expert_intermediate_size % (m.moe_ffn_hidden_size or
                                                       m.ffn_hidden_size),
             f"--moe-shared-expert-intermediate-size {m.moe_shared_expert_intermediate_size}: "
             "DeepseekV3ForCausalLM's shared experts are a whole number of routed experts' "
             "width"),
            (m.moe_router_num_groups is not None and
             m.moe_router_topk // (m.moe_router_group_topk or 1) != GROUP_SCORE_TOP,
             f"--moe-router-topk {m.moe_router_topk} / --moe-router-group-topk "
             f"{m.moe_router_group_topk}: megatron-core ranks groups by their top topk / "
             f"group_topk scores, DeepseekV3ForCausalLM by their top {GROUP_SCORE_TOP}"),
            (m.moe_router_topk == 1, "--moe-router-topk 1: megatron-core does not "
             "renormalise one score, DeepseekV3ForCausalLM does"),
        ]
        if m.norm_epsilon != LATENT_NORM_EPS:
            raise UserError(f"{where}: --norm-epsilon {m.norm_epsilon}: DeepseekV3ForCausalLM's "
                            f"latent norms always use {LATENT_NORM_EPS} (as DeepSeek-V3 does); "
                            "train with --norm-epsilon 1e-6 to export")
        for refused, why in refusals if m.num_experts else refusals[:1]:
            if refused:
                raise UserError(f"{where}: {why}")

    def to_hf(self, state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
        m = config.model
        out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
               "model.norm.weight": state["decoder.final_layernorm.weight"],
               **output_layer_to_hf(state, config)}
        for layer in range(m.num_layers):
            ours, theirs = f"decoder.layers.{layer}.", f"model.layers.{layer}."
            out[theirs + "input_layernorm.weight"] = state[ours + "input_layernorm.weight"]
            out[theirs + "post_attention_layernorm.weight"] = \
                state[ours + "pre_mlp_layernorm.weight"]
            for hf, mine in _attention_names(config).items():
                out[f"{theirs}self_attn.{hf}.weight"] = state[f"{ours}{ATTENTION}{mine}.weight"]
            if not _is_moe(config, layer):
                out.update(_swiglu_to_hf(state[ours + "mlp.linear_fc1.weight"],
                                         state[ours + "mlp.linear_fc2.weight"], theirs + "mlp."))
                continue
            out[theirs + "mlp.gate.weight"] = state[ours + "mlp.router.weight"]
            out[theirs + "mlp.gate.e_score_correction_bias"] = \
                state[ours + "mlp.router.expert_bias"]
            for expert in range(m.num_experts):
                mine = f"{ours}{EXPERTS}{expert}."
                out.update(_swiglu_to_hf(state[mine + "linear_fc1.weight"],
                                         state[mine + "linear_fc2.weight"],
                                         f"{theirs}mlp.experts.{expert}."))
            out.update(_swiglu_to_hf(state[ours + SHARED + "linear_fc1.weight"],
                                     state[ours + SHARED + "linear_fc2.weight"],
                                     theirs + "mlp.shared_experts."))
        return {name: tensor.contiguous() for name, tensor in out.items()}

    def from_hf(self, weights: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
        """The inverse of `to_hf` (a tied model has no output layer weight of its own)."""
        m = config.model
        out = {"embedding.word_embeddings.weight": weights["model.embed_tokens.weight"],
               "decoder.final_layernorm.weight": weights["model.norm.weight"],
               **output_layer_from_hf(weights, config)}
        for layer in range(m.num_layers):
            ours, theirs = f"decoder.layers.{layer}.", f"model.layers.{layer}."
            out[ours + "input_layernorm.weight"] = weights[theirs + "input_layernorm.weight"]
            out[ours + "pre_mlp_layernorm.weight"] = \
                weights[theirs + "post_attention_layernorm.weight"]
            for hf, mine in _attention_names(config).items():
                out[f"{ours}{ATTENTION}{mine}.weight"] = weights[f"{theirs}self_attn.{hf}.weight"]
            if not _is_moe(config, layer):
                out.update(_swiglu_from_hf(weights, theirs + "mlp.", ours + "mlp."))
                continue
            out[ours + "mlp.router.weight"] = weights[theirs + "mlp.gate.weight"]
            out[ours + "mlp.router.expert_bias"] = \
                weights[theirs + "mlp.gate.e_score_correction_bias"]
            for expert in range(m.num_experts):
                out.update(_swiglu_from_hf(weights, f"{theirs}mlp.experts.{expert}.",
                                           f"{ours}{EXPERTS}{expert}."))
            out.update(_swiglu_from_hf(weights, theirs + "mlp.shared_experts.", ours + SHARED))
        return {name: tensor.contiguous() for name, tensor in out.items()}

    def hf_config(self, config, padded_vocab_size: int, tokenizer, dtype: str) -> dict:
        m, s = config.model, config.mla
        routed = m.moe_ffn_hidden_size or m.ffn_hidden_size
        rope = {"rope_theta": float(m.rotary_base), "rope_type": "default"}
        if s.rotary_scaling_factor != 1.0:
            optional = {"beta_fast": s.yarn_beta_fast, "beta_slow": s.yarn_beta_slow,
                        "original_max_position_embeddings":
                            s.yarn_original_max_position_embeddings}
            rope = {**rope, "rope_type": "yarn", "factor": s.rotary_scaling_factor,
                    "mscale": s.mscale, "mscale_all_dim": s.mscale_all_dim,
                    **{k: v for k, v in optional.items() if v is not None}}
        return {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "vocab_size": padded_vocab_size, "hidden_size": m.hidden_size,
            "intermediate_size": m.ffn_hidden_size, "moe_intermediate_size": routed,
            "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
            "num_key_value_heads": m.num_attention_heads,
            "n_shared_experts": m.moe_shared_expert_intermediate_size // routed,
            "n_routed_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk,
            "routed_scaling_factor": m.moe_router_topk_scaling_factor or 1.0,
            "n_group": m.moe_router_num_groups or 1, "topk_group": m.moe_router_group_topk or 1,
            "norm_topk_prob": True, "first_k_dense_replace": m.moe_first_dense_layers,
            "q_lora_rank": s.q_lora_rank, "kv_lora_rank": s.kv_lora_rank,
            "qk_nope_head_dim": s.qk_head_dim, "qk_rope_head_dim": s.qk_pos_emb_head_dim,
            "v_head_dim": s.v_head_dim, "head_dim": s.qk_pos_emb_head_dim,
            "rope_interleave": True, "hidden_act": "silu",
            "max_position_embeddings": m.max_position_embeddings or m.seq_length,
            "rms_norm_eps": m.norm_epsilon, "initializer_range": m.init_method_std,
            "rope_theta": float(m.rotary_base), "rope_parameters": rope,
            "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
            "attention_bias": False,
            "attention_dropout": m.attention_dropout, "num_nextn_predict_layers": 0,
            "use_cache": True, "bos_token_id": tokenizer.bos if tokenizer.bos >= 0 else None,
            "eos_token_id": tokenizer.eod,
            "pad_token_id": tokenizer.pad if tokenizer.pad >= 0 else None,
            "torch_dtype": dtype, "dtype": dtype,
        }

    def sections(self, hf: dict, where: str) -> dict[str, dict]:
        """Our model and mla sections for a DeepseekV3 config (a UserError names any setting
        the family cannot build)."""
        if hf.get("attention_bias"):
            raise UserError(f"{where}: attention_bias true is not built by the deepseek-mla "
                            "family")
        if hf.get("rope_interleave", True) is not True:
            raise UserError(f"{where}: rope_interleave false: megatron-core's MLA rotates a "
                            "head's RoPE dimensions interleaved (DeepSeek-V3's layout)")
        if hf.get("hidden_act", "silu") != "silu":
            raise UserError(f"{where}: hidden_act {hf['hidden_act']!r}: the MLP is SwiGLU")
        if float(hf.get("rms_norm_eps", LATENT_NORM_EPS)) != LATENT_NORM_EPS:
            raise UserError(f"{where}: rms_norm_eps {hf['rms_norm_eps']}: transformers' latent "
                            f"norms use {LATENT_NORM_EPS} whatever it says, megatron-core's "
                            "one epsilon for every norm (DeepSeek-V3 has 1e-6)")
        try:
            top_k, groups = int(hf["num_experts_per_tok"]), int(hf.get("n_group") or 1)
            topk_group = int(hf.get("topk_group") or 1)
            if not hf.get("norm_topk_prob", True) and top_k > 1:
                raise UserError(f"{where}: norm_topk_prob false: megatron-core renormalises "
                                "the top-k sigmoid scores")
            if groups > 1 and top_k // topk_group != GROUP_SCORE_TOP:
                raise UserError(f"{where}: num_experts_per_tok {top_k} / topk_group "
                                f"{topk_group}: megatron-core ranks groups by their top "
                                f"topk / group_topk scores, transformers by their top "
                                f"{GROUP_SCORE_TOP}")
            routed = int(hf["moe_intermediate_size"])
            rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
            model = {
                "num_layers": int(hf["num_hidden_layers"]), "hidden_size": int(hf["hidden_size"]),
                "ffn_hidden_size": int(hf["intermediate_size"]),
                "num_attention_heads": int(hf["num_attention_heads"]),
                "max_position_embeddings": int(hf.get("max_position_embeddings", 4096)),
                "rotary_base": int(float(rope.get("rope_theta", hf.get("rope_theta", 10000)))),
                "norm_epsilon": LATENT_NORM_EPS,
                "init_method_std": float(hf.get("initializer_range", 0.02)),
                "untie_embeddings_and_output_weights": not tied(hf),
                "num_experts": int(hf["n_routed_experts"]), "moe_router_topk": top_k,
                "moe_ffn_hidden_size": routed,
                "moe_shared_expert_intermediate_size": routed * int(hf.get("n_shared_experts")
                                                                    or 1),
                "moe_first_dense_layers": int(hf.get("first_k_dense_replace", 0)),
                "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0,
                "moe_router_topk_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
                **({"moe_router_num_groups": groups, "moe_router_group_topk": topk_group}
                   if groups > 1 else {}),
            }
            q_lora = hf.get("q_lora_rank")
            mla = {"q_lora_rank": int(q_lora) if q_lora else None,
                   "kv_lora_rank": int(hf["kv_lora_rank"]),
                   "qk_head_dim": int(hf["qk_nope_head_dim"]),
                   "qk_pos_emb_head_dim": int(hf["qk_rope_head_dim"]),
                   "v_head_dim": int(hf["v_head_dim"]), **_rope_sections(rope, where)}
        except (KeyError, TypeError, ValueError) as error:
            raise UserError(f"{where}: not a complete DeepseekV3 config "
                            f"({type(error).__name__}: {error})") from None
        return {"model": model, "mla": mla}

    def unused_weights(self, weights: dict, hf: dict) -> list[str]:
        """The multi-token-prediction layers' weights (transformers' model has none), and a
        tied model's head saved beside its embedding."""
        first = int(hf["num_hidden_layers"])
        return [name for name in weights if name.startswith("model.layers.") and
                int(name.split(".")[2]) >= first] + tied_head_on_disk(weights, hf)


DEEPSEEK_V3_HF = DeepSeekV3HF()
