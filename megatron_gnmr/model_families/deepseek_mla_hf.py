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

from collections.abc import Iterator

import torch

from megatron_gnmr.errors import UserError
from megatron_gnmr.limits import MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_SEQUENCE, MAX_WIDTH
from megatron_gnmr.model_families.checked_hf import (ConfigJson, Expected, outer_weights,
                                                     rope_table, rope_theta, rope_type)
from megatron_gnmr.model_families.tied_hf import (output_layer_from_hf, output_layer_to_hf,
                                                  tied_head_on_disk)

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


def _swiglu_shapes(at: str, inner: int, hidden: int, inner_by: str, hidden_by: str) -> dict:
    return {at + "gate_proj.weight": Expected((inner, hidden), f"{inner_by}, {hidden_by}"),
            at + "up_proj.weight": Expected((inner, hidden), f"{inner_by}, {hidden_by}"),
            at + "down_proj.weight": Expected((hidden, inner), f"{hidden_by}, {inner_by}")}


def _is_moe(config, layer: int) -> bool:
    return layer >= config.model.moe_first_dense_layers


def _rope_sections(rope: ConfigJson, where: str) -> dict:
    kind = rope_type(rope)
    if kind == "default":
        return {}
    if kind != "yarn":
        raise UserError(f"{where}: config.json's rope type {kind!r} is not built by the "
                        "deepseek-mla family (plain RoPE, or YaRN)")
    # beta: rotations over the original context, which no dimension makes more of than there
    # are positions (published: 32 and 1); near 1e308 megatron-core's YaRN takes the log of 0
    optional = {"yarn_beta_fast": rope.number("beta_fast", None, gt=0, le=MAX_SEQUENCE),
                "yarn_beta_slow": rope.number("beta_slow", None, gt=0, le=MAX_SEQUENCE),
                "yarn_original_max_position_embeddings":
                    rope.integer("original_max_position_embeddings", None, le=MAX_SEQUENCE)}
    return {"rotary_scaling_factor": rope.number("factor", ge=1),
            "mscale": rope.number("mscale", 1.0, gt=0),
            "mscale_all_dim": rope.number("mscale_all_dim", 0.0, ge=0),
            **{k: v for k, v in optional.items() if v is not None}}


def _renamed(config) -> Iterator[tuple[str, str]]:
    """(megatron's name, transformers' name) of every tensor that maps one to one: the one map
    both directions read."""
    yield "embedding.word_embeddings.weight", "model.embed_tokens.weight"
    yield "decoder.final_layernorm.weight", "model.norm.weight"
    for layer in range(config.model.num_layers):
        ours, theirs = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        yield ours + "input_layernorm.weight", theirs + "input_layernorm.weight"
        yield ours + "pre_mlp_layernorm.weight", theirs + "post_attention_layernorm.weight"
        for hf, mine in _attention_names(config).items():
            yield f"{ours}{ATTENTION}{mine}.weight", f"{theirs}self_attn.{hf}.weight"
        if _is_moe(config, layer):
            yield ours + "mlp.router.weight", theirs + "mlp.gate.weight"
            yield ours + "mlp.router.expert_bias", theirs + "mlp.gate.e_score_correction_bias"


def _swiglus(config) -> Iterator[tuple[str, str]]:
    """(megatron's prefix, transformers') of every SwiGLU MLP: megatron's fc1 is [gate; up],
    its fc2 is down_proj."""
    for layer in range(config.model.num_layers):
        ours, theirs = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        if not _is_moe(config, layer):
            yield ours + "mlp.", theirs + "mlp."
            continue
        for expert in range(config.model.num_experts):
            yield f"{ours}{EXPERTS}{expert}.", f"{theirs}mlp.experts.{expert}."
        yield ours + SHARED, theirs + "mlp.shared_experts."


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
        out = {theirs: state[ours] for ours, theirs in _renamed(config)}
        out.update(output_layer_to_hf(state, config))
        for ours, theirs in _swiglus(config):
            out.update(_swiglu_to_hf(state[ours + "linear_fc1.weight"],
                                     state[ours + "linear_fc2.weight"], theirs))
        return {name: tensor.contiguous() for name, tensor in out.items()}

    def from_hf(self, weights: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
        """The inverse of `to_hf` (a tied model has no output layer weight of its own)."""
        out = {ours: weights[theirs] for ours, theirs in _renamed(config)}
        out.update(output_layer_from_hf(weights, config))
        for ours, theirs in _swiglus(config):
            out.update(_swiglu_from_hf(weights, theirs, ours))
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
        """Our model and mla sections for a DeepseekV3 config, every field read checked (a
        UserError names any setting the family cannot build)."""
        config = ConfigJson(hf, where)
        if config.boolean("attention_bias", False):
            raise UserError(f"{where}: config.json's attention_bias true is not built by the "
                            "deepseek-mla family")
        if not config.boolean("rope_interleave", True):
            raise UserError(f"{where}: config.json's rope_interleave false: megatron-core's MLA "
                            "rotates a head's RoPE dimensions interleaved (DeepSeek-V3's layout)")
        if config.word("hidden_act", "silu") != "silu":
            raise UserError(f"{where}: config.json's hidden_act {hf['hidden_act']!r}: the MLP is "
                            "SwiGLU")
        if config.number("rms_norm_eps", LATENT_NORM_EPS, gt=0) != LATENT_NORM_EPS:
            raise UserError(f"{where}: config.json's rms_norm_eps {hf['rms_norm_eps']}: "
                            f"transformers' latent norms use {LATENT_NORM_EPS} whatever it says, "
                            "megatron-core's one epsilon for every norm (DeepSeek-V3 has 1e-6)")
        layers = config.integer("num_hidden_layers", le=MAX_LAYERS)
        config.integer("num_nextn_predict_layers", 0, ge=0, le=MAX_LAYERS)  # `unused_weights`
        experts = config.integer("n_routed_experts", ge=2, le=MAX_EXPERTS)
        top_k = config.integer("num_experts_per_tok", le=experts)
        groups = config.integer("n_group", 1, le=experts)
        config.dividing("n_group", groups, "n_routed_experts", experts)
        topk_group = config.integer("topk_group", 1, le=groups)
        if not config.boolean("norm_topk_prob", True) and top_k > 1:
            raise UserError(f"{where}: config.json's norm_topk_prob false: megatron-core "
                            "renormalises the top-k sigmoid scores")
        if groups > 1 and top_k // topk_group != GROUP_SCORE_TOP:
            raise UserError(f"{where}: config.json's num_experts_per_tok {top_k} / topk_group "
                            f"{topk_group}: megatron-core ranks groups by their top "
                            f"topk / group_topk scores, transformers by their top "
                            f"{GROUP_SCORE_TOP}")
        routed = config.integer("moe_intermediate_size", le=MAX_WIDTH)
        rope = rope_table(config)
        model = {
            "num_layers": layers, "hidden_size": config.integer("hidden_size", le=MAX_WIDTH),
            "ffn_hidden_size": config.integer("intermediate_size", le=MAX_WIDTH),
            "num_attention_heads": config.integer("num_attention_heads", le=MAX_HEADS),
            "max_position_embeddings": config.integer("max_position_embeddings", 4096,
                                                      le=MAX_SEQUENCE),
            "rotary_base": rope_theta(config, rope), "norm_epsilon": LATENT_NORM_EPS,
            "init_method_std": config.number("initializer_range", 0.02, gt=0),
            "padded_vocab_size": config.integer("vocab_size"),  # the embedding's rows: checked
            "untie_embeddings_and_output_weights": not config.boolean("tie_word_embeddings"),
            "num_experts": experts, "moe_router_topk": top_k, "moe_ffn_hidden_size": routed,
            "moe_shared_expert_intermediate_size":
                routed * config.integer("n_shared_experts", 1, le=MAX_EXPERTS),
            "moe_first_dense_layers": config.integer("first_k_dense_replace", 0, ge=0,
                                                     le=layers),
            "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0,
            "moe_router_topk_scaling_factor": config.number("routed_scaling_factor", 1.0, gt=0),
            **({"moe_router_num_groups": groups, "moe_router_group_topk": topk_group}
               if groups > 1 else {}),
        }
        rope_dim = config.integer("qk_rope_head_dim", ge=2, le=MAX_WIDTH)
        if rope_dim % 2:
            config.fail("qk_rope_head_dim", "must be even (RoPE rotates pairs)")
        mla = {"q_lora_rank": config.integer("q_lora_rank", None, le=MAX_WIDTH),
               "kv_lora_rank": config.integer("kv_lora_rank", le=MAX_WIDTH),
               "qk_head_dim": config.integer("qk_nope_head_dim", le=MAX_WIDTH),
               "qk_pos_emb_head_dim": rope_dim,
               "v_head_dim": config.integer("v_head_dim", le=MAX_WIDTH),
               **_rope_sections(rope, where)}
        return {"model": model, "mla": mla}

    def expected_weights(self, sections: dict, hf: dict) -> Iterator[tuple[str, Expected]]:
        """Every tensor transformers' DeepseekV3 holds for this config, with its shape and the
        fields of config.json that make it (lazily: `checked_hf.check_weights` stops early)."""
        m, s = sections["model"], sections["mla"]
        hidden, heads, vocab = m["hidden_size"], m["num_attention_heads"], m["padded_vocab_size"]
        nope, rope, v = s["qk_head_dim"], s["qk_pos_emb_head_dim"], s["v_head_dim"]
        kv, q_lora = s["kv_lora_rank"], s["q_lora_rank"]
        routed, experts = m["moe_ffn_hidden_size"], m["num_experts"]
        shared = m["moe_shared_expert_intermediate_size"]
        h, n = f"hidden_size {hidden}", f"num_attention_heads {heads}"
        qk = f"{n} x (qk_nope_head_dim {nope} + qk_rope_head_dim {rope})"
        yield from outer_weights(m, hidden, vocab)
        for layer in range(m["num_layers"]):
            at = f"model.layers.{layer}."
            out = {at + "input_layernorm.weight": Expected((hidden,), h),
                   at + "post_attention_layernorm.weight": Expected((hidden,), h)}
            a = at + "self_attn."
            if q_lora is None:
                out[a + "q_proj.weight"] = Expected((heads * (nope + rope), hidden), f"{qk}, {h}")
            else:
                r = f"q_lora_rank {q_lora}"
                out.update({a + "q_a_proj.weight": Expected((q_lora, hidden), f"{r}, {h}"),
                            a + "q_a_layernorm.weight": Expected((q_lora,), r),
                            a + "q_b_proj.weight": Expected((heads * (nope + rope), q_lora),
                                                            f"{qk}, {r}")})
            k = f"kv_lora_rank {kv}"
            out.update({
                a + "kv_a_proj_with_mqa.weight": Expected(
                    (kv + rope, hidden), f"{k} + qk_rope_head_dim {rope}, {h}"),
                a + "kv_a_layernorm.weight": Expected((kv,), k),
                a + "kv_b_proj.weight": Expected(
                    (heads * (nope + v), kv), f"{n} x (qk_nope_head_dim {nope} + v_head_dim {v}), "
                    f"{k}"),
                a + "o_proj.weight": Expected((hidden, heads * v), f"{h}, {n} x v_head_dim {v}")})
            if layer < m["moe_first_dense_layers"]:
                out.update(_swiglu_shapes(at + "mlp.", m["ffn_hidden_size"], hidden,
                                          f"intermediate_size {m['ffn_hidden_size']}", h))
                yield from out.items()
                continue
            e = f"n_routed_experts {experts}"
            out.update({at + "mlp.gate.weight": Expected((experts, hidden), f"{e}, {h}"),
                        at + "mlp.gate.e_score_correction_bias": Expected((experts,), e)})
            out.update(_swiglu_shapes(at + "mlp.shared_experts.", shared, hidden,
                                      f"moe_intermediate_size {routed} x n_shared_experts "
                                      f"{shared // routed}", h))
            yield from out.items()
            for expert in range(experts):
                yield from _swiglu_shapes(f"{at}mlp.experts.{expert}.", routed, hidden,
                                          f"moe_intermediate_size {routed}", h).items()

    def unused_weights(self, weights: dict, hf: dict) -> list[str]:
        """The multi-token-prediction layers' weights (transformers' model has none: the
        `num_nextn_predict_layers` after the last decoder layer, DeepSeek-V3's layer 61), and a
        tied model's head saved beside its embedding. Any other layer beyond the config's is
        the weights disagreeing with it (`checked_hf.check_weights` refuses it)."""
        first = hf["num_hidden_layers"]  # both read and checked by `sections`
        after = range(first, first + (hf.get("num_nextn_predict_layers") or 0))
        return [name for name in weights if name.startswith("model.layers.") and
                name.split(".")[2].isdigit() and int(name.split(".")[2]) in after] + \
            tied_head_on_disk(weights, hf)


DEEPSEEK_V3_HF = DeepSeekV3HF()
