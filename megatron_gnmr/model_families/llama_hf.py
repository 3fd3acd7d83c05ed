"""The LLaMA family's Hugging Face mapping: its weights in transformers' names and layout, and
its config both ways, as pure functions of full (unsharded) state dicts and config dicts.
export-hf, import-hf and the PEFT adapter dispatch on the family (`family.hf`); this is the
llama family's. Dense runs are `LlamaForCausalLM` (`MistralForCausalLM` without a sliding window
reads the same); MoE runs (--num-experts) are `MixtralForCausalLM`.

megatron's fused QKV weight is interleaved per query group (`llama_layout.unfused_qkv`);
Hugging Face keeps q_proj, k_proj and v_proj apart, heads in order. megatron's fc1 stacks
[gate; up]; Hugging Face has gate_proj and up_proj (Mixtral's experts: w1 the gate, w3 the up,
w2 the down projection, on disk one tensor per expert as transformers saves them). RoPE needs
no permutation: megatron's default (`rotary_interleaved=False`) rotates halves of each head,
as Hugging Face's `rotate_half`. A zero-centred norm (--apply-layernorm-1p) stores gamma - 1;
Hugging Face stores gamma. Mixtral's router (softmax over every expert, top-k, renormalised)
is megatron's softmax over the top-k scores: the same gates. A tied model
(`tie_word_embeddings`, Llama 3.2 1B and 3B) stays tied: megatron-core's
share_embeddings_and_output_weights, one matrix, and no `lm_head.weight` on disk either way.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megatron_gnmr.errors import UserError
from megatron_gnmr.limits import MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_SEQUENCE, MAX_WIDTH
from megatron_gnmr.model_families.checked_hf import (ConfigJson, Expected, outer_weights,
                                                     rope_table, rope_theta, rope_type)
from megatron_gnmr.model_families.llama_layout import (PROJ, QKV, fused_qkv, head_dim,
                                                       unfused_qkv)
from megatron_gnmr.model_families.tied_hf import (output_layer_from_hf, output_layer_to_hf,
                                                  tied_head_on_disk)

ATTENTION = "self_attention."
EXPERTS = "mlp.experts.local_experts."
# Llama 3's RoPE scaling as megatron-core builds it (`RotaryEmbedding._apply_scaling`): only
# the factor is a setting; every published Llama 3.1-3.3 checkpoint has these bands
LLAMA3_BANDS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
UNSUPPORTED = {  # Hugging Face settings this family cannot build -> what it builds instead
    "attention_bias": (True, "no bias in the attention projections"),
    "mlp_bias": (True, "no bias in the MLP"),
}
# what a MoE run must be for Mixtral's class to express it: (setting, value Mixtral has)
MIXTRAL_ROUTING = (("moe_first_dense_layers", 0), ("moe_shared_expert_intermediate_size", None),
                   ("moe_router_score_function", "softmax"),
                   ("moe_router_enable_expert_bias", False), ("moe_router_pre_softmax", False),
                   ("moe_router_num_groups", None), ("moe_router_topk_scaling_factor", None))


def _shape(config) -> tuple[int, int, int, int]:
    m = config.model
    groups = m.num_query_groups or m.num_attention_heads
    return m.num_attention_heads, groups, head_dim(m), m.hidden_size


def _mlp_to_hf(state: dict, ours: str, theirs: str, config) -> dict:
    if not config.model.num_experts:
        gate, up = state[ours + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        return {theirs + "mlp.gate_proj.weight": gate, theirs + "mlp.up_proj.weight": up,
                theirs + "mlp.down_proj.weight": state[ours + "mlp.linear_fc2.weight"]}
    out = {theirs + "block_sparse_moe.gate.weight": state[ours + "mlp.router.weight"]}
    for expert in range(config.model.num_experts):
        mine, hers = f"{ours}{EXPERTS}{expert}.", f"{theirs}block_sparse_moe.experts.{expert}."
        gate, up = state[mine + "linear_fc1.weight"].chunk(2, dim=0)
        out.update({hers + "w1.weight": gate, hers + "w3.weight": up,
                    hers + "w2.weight": state[mine + "linear_fc2.weight"]})
    return out


def _mlp_from_hf(weights: dict, ours: str, theirs: str, config) -> dict:
    if not config.model.num_experts:
        return {ours + "mlp.linear_fc1.weight": torch.cat([weights[theirs + "mlp.gate_proj.weight"],
                                                           weights[theirs + "mlp.up_proj.weight"]]),
                ours + "mlp.linear_fc2.weight": weights[theirs + "mlp.down_proj.weight"]}
    out = {ours + "mlp.router.weight": weights[theirs + "block_sparse_moe.gate.weight"]}
    for expert in range(config.model.num_experts):
        mine, hers = f"{ours}{EXPERTS}{expert}.", f"{theirs}block_sparse_moe.experts.{expert}."
        out.update({mine + "linear_fc1.weight": torch.cat([weights[hers + "w1.weight"],
                                                           weights[hers + "w3.weight"]]),
                    mine + "linear_fc2.weight": weights[hers + "w2.weight"]})
    return out


def _rope_scaling(rope: ConfigJson, where: str) -> dict:
    """Our model values for a Hugging Face rope config: plain, or llama3 with megatron-core's
    bands (anything else refused by name)."""
    kind = rope_type(rope)
    if kind == "default":
        return {}
    if kind != "llama3":
        raise UserError(f"{where}: config.json's rope type {kind!r} is not built by the llama "
                        "family (plain RoPE, or llama3's frequency scaling)")
    for key, value in LLAMA3_BANDS.items():
        if rope.number(key, value) != value:
            raise UserError(f"{where}: config.json's rope {key} {rope.values[key]}: "
                            f"megatron-core's llama3 scaling has {value} (only the factor is a "
                            "setting)")
    return {"use_rope_scaling": True, "rope_scaling_factor": rope.number("factor", 8.0, ge=1)}


class LlamaHF:
    """The llama family's `family.hf`."""

    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")
    model_types = ("llama", "mistral", "mixtral")
    # our unit linear -> Hugging Face's projections it holds, in the order of its weight's
    # rows (the PEFT adapter splits a fused linear's B by them)
    projections = {f"{ATTENTION}{QKV}": ("self_attn.q_proj", "self_attn.k_proj",
                                         "self_attn.v_proj"),
                   f"{ATTENTION}{PROJ}": ("self_attn.o_proj",),
                   "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
                   "mlp.linear_fc2": ("mlp.down_proj",)}

    def exportable(self, config, where: str) -> None:
        """A UserError naming what of this run transformers' classes cannot express."""
        m = config.model
        for name, value in MIXTRAL_ROUTING if m.num_experts else ():
            if getattr(m, name) != value:
                raise UserError(f"{where}: --{name.replace('_', '-')} {getattr(m, name)}: "
                                f"MixtralForCausalLM has {value}")

    def unfuse_qkv(self, weight: torch.Tensor, config) -> tuple[torch.Tensor, ...]:
        return unfused_qkv(weight, config.model)

    def to_hf(self, state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
        one = 1.0 if config.model.apply_layernorm_1p else 0.0
        out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
               "model.norm.weight": state["decoder.final_layernorm.weight"] + one,
               **output_layer_to_hf(state, config)}
        for layer in range(config.model.num_layers):
            ours, theirs = f"decoder.layers.{layer}.", f"model.layers.{layer}."
            q, k, v = unfused_qkv(state[f"{ours}{ATTENTION}{QKV}.weight"], config.model)
            out.update({
                theirs + "self_attn.q_proj.weight": q,
                theirs + "self_attn.k_proj.weight": k,
                theirs + "self_attn.v_proj.weight": v,
                theirs + "self_attn.o_proj.weight": state[f"{ours}{ATTENTION}{PROJ}.weight"],
                theirs + "input_layernorm.weight": state[ours + "input_layernorm.weight"] + one,
                theirs + "post_attention_layernorm.weight":
                    state[ours + "pre_mlp_layernorm.weight"] + one,
                **_mlp_to_hf(state, ours, theirs, config),
            })
        return {name: tensor.contiguous() for name, tensor in out.items()}

    def from_hf(self, weights: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
        """The inverse of `to_hf` (a tied model has no output layer weight of its own)."""
        one = 1.0 if config.model.apply_layernorm_1p else 0.0
        out = {"embedding.word_embeddings.weight": weights["model.embed_tokens.weight"],
               "decoder.final_layernorm.weight": weights["model.norm.weight"] - one,
               **output_layer_from_hf(weights, config)}
        for layer in range(config.model.num_layers):
            ours, theirs = f"decoder.layers.{layer}.", f"model.layers.{layer}."
            q, k, v = (weights[f"{theirs}self_attn.{name}_proj.weight"] for name in "qkv")
            out.update({
                f"{ours}{ATTENTION}{QKV}.weight": fused_qkv(q, k, v, config.model),
                f"{ours}{ATTENTION}{PROJ}.weight": weights[theirs + "self_attn.o_proj.weight"],
                ours + "input_layernorm.weight": weights[theirs + "input_layernorm.weight"] - one,
                ours + "pre_mlp_layernorm.weight":
                    weights[theirs + "post_attention_layernorm.weight"] - one,
                **_mlp_from_hf(weights, ours, theirs, config),
            })
        return {name: tensor.contiguous() for name, tensor in out.items()}

    def hf_config(self, config, padded_vocab_size: int, tokenizer, dtype: str) -> dict:
        """Hugging Face's config.json for this model (written without transformers)."""
        m = config.model
        heads, groups, d, _ = _shape(config)
        moe = {"num_local_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk,
               "router_aux_loss_coef": m.moe_aux_loss_coeff, "output_router_logits": False,
               "router_jitter_noise": 0.0, "sliding_window": None} if m.num_experts else {}
        return {
            "architectures": ["MixtralForCausalLM" if m.num_experts else "LlamaForCausalLM"],
            "model_type": "mixtral" if m.num_experts else "llama",
            "vocab_size": padded_vocab_size, "hidden_size": m.hidden_size,
            "intermediate_size": (m.moe_ffn_hidden_size or m.ffn_hidden_size)
            if m.num_experts else m.ffn_hidden_size,
            "num_hidden_layers": m.num_layers, "num_attention_heads": heads,
            "num_key_value_heads": groups, "head_dim": d, "hidden_act": "silu",
            "max_position_embeddings": m.max_position_embeddings or m.seq_length,
            "rms_norm_eps": m.norm_epsilon, "initializer_range": m.init_method_std,
            "rope_theta": float(m.rotary_base),
            "rope_parameters": {"rope_theta": float(m.rotary_base), **(
                {"rope_type": "llama3", **LLAMA3_BANDS, "factor": m.rope_scaling_factor}
                if m.use_rope_scaling else {"rope_type": "default"})},
            "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
            "attention_bias": False, "mlp_bias": False,
            "attention_dropout": m.attention_dropout, "use_cache": True,
            "bos_token_id": tokenizer.bos if tokenizer.bos >= 0 else None,
            "eos_token_id": tokenizer.eod,
            "pad_token_id": tokenizer.pad if tokenizer.pad >= 0 else None,
            "torch_dtype": dtype, "dtype": dtype, **moe,
        }

    def unused_weights(self, weights: dict, hf: dict) -> list[str]:
        return tied_head_on_disk(weights, hf)  # every other weight is the model's

    def sections(self, hf: dict, where: str) -> dict[str, dict]:
        """Our model section for a Hugging Face config of this family (a UserError names any
        setting the family cannot build)."""
        return {"model": self._model(hf, where)}

    def _model(self, hf: dict, where: str) -> dict:
        config = ConfigJson(hf, where)
        for key, (bad, ours) in UNSUPPORTED.items():
            if config.boolean(key, False) == bad:
                raise UserError(f"{where}: config.json's {key} {bad} is not built by the llama "
                                f"family ({ours})")
        if hf.get("sliding_window") is not None:
            raise UserError(f"{where}: config.json's sliding_window {hf['sliding_window']}: the "
                            "llama family's attention is full causal attention (a Mistral or "
                            "Mixtral without a sliding window imports)")
        if config.word("hidden_act", "silu") != "silu":
            raise UserError(f"{where}: config.json's hidden_act {hf['hidden_act']!r}: the llama "
                            "family's MLP is SwiGLU (silu)")
        rope = rope_table(config)
        hidden = config.integer("hidden_size", le=MAX_WIDTH)
        heads = config.integer("num_attention_heads", le=MAX_HEADS)
        groups = config.integer("num_key_value_heads", heads, le=heads)
        config.dividing("num_key_value_heads", groups, "num_attention_heads", heads)
        if hf.get("head_dim") is None and hidden < heads:
            config.fail("num_attention_heads", f"more heads than hidden_size {hidden}, and no "
                        "head_dim")
        model = {
            "num_layers": config.integer("num_hidden_layers", le=MAX_LAYERS),
            "hidden_size": hidden, "num_attention_heads": heads, "num_query_groups": groups,
            "ffn_hidden_size": config.integer("intermediate_size", le=MAX_WIDTH),
            # transformers' own rule: head_dim, else hidden_size // num_attention_heads
            "kv_channels": config.integer("head_dim", hidden // heads, le=MAX_WIDTH),
            "max_position_embeddings": config.integer("max_position_embeddings", 2048,
                                                      le=MAX_SEQUENCE),
            "rotary_base": rope_theta(config, rope),
            "norm_epsilon": config.number("rms_norm_eps", 1e-6, gt=0),
            "init_method_std": config.number("initializer_range", 0.02, gt=0),
            "padded_vocab_size": config.integer("vocab_size"),  # the embedding's rows: checked
            "untie_embeddings_and_output_weights": not config.boolean("tie_word_embeddings"),
            **_rope_scaling(rope, where),
        }
        if _is_mixtral(hf):  # transformers' MixtralConfig defaults
            experts = config.integer("num_local_experts", 8, ge=2, le=MAX_EXPERTS)
            top_k = config.integer("num_experts_per_tok", 2, le=experts)
            if top_k == 1:  # megatron-core's TransformerConfig refuses it
                config.fail("num_experts_per_tok", "megatron-core builds top-1 routing only "
                            "with the softmax before the top-k, whose gates are not Mixtral's "
                            "(1.0)")
            model.update(num_experts=experts, moe_router_topk=top_k,
                         moe_aux_loss_coeff=config.number("router_aux_loss_coef", 0.0, ge=0))
        return model

    def expected_weights(self, sections: dict, hf: dict) -> Iterator[tuple[str, Expected]]:
        """Every tensor transformers' class holds for this config, with its shape and the
        fields of config.json that make it (lazily: `checked_hf.check_weights` stops early)."""
        m = sections["model"]
        hidden, ffn, d = m["hidden_size"], m["ffn_hidden_size"], m["kv_channels"]
        heads, groups, vocab = m["num_attention_heads"], m["num_query_groups"], \
            m["padded_vocab_size"]
        h = f"hidden_size {hidden}"
        width = f"head_dim {d}" if hf.get("head_dim") is not None else \
            f"head_dim {d} (hidden_size // num_attention_heads)"
        q, kv = f"num_attention_heads {heads} x {width}", f"num_key_value_heads {groups} x {width}"
        f = f"intermediate_size {ffn}"
        yield from outer_weights(m, hidden, vocab)
        for layer in range(m["num_layers"]):
            at = f"model.layers.{layer}."
            attention = at + "self_attn."
            yield from {attention + "q_proj.weight": Expected((heads * d, hidden), f"{q}, {h}"),
                        attention + "k_proj.weight": Expected((groups * d, hidden), f"{kv}, {h}"),
                        attention + "v_proj.weight": Expected((groups * d, hidden), f"{kv}, {h}"),
                        attention + "o_proj.weight": Expected((hidden, heads * d), f"{h}, {q}"),
                        at + "input_layernorm.weight": Expected((hidden,), h),
                        at + "post_attention_layernorm.weight": Expected((hidden,), h)}.items()
            if not m.get("num_experts"):
                yield from {at + "mlp.gate_proj.weight": Expected((ffn, hidden), f"{f}, {h}"),
                            at + "mlp.up_proj.weight": Expected((ffn, hidden), f"{f}, {h}"),
                            at + "mlp.down_proj.weight": Expected((hidden, ffn), f"{h}, {f}")
                            }.items()
                continue
            experts = m["num_experts"]
            yield at + "block_sparse_moe.gate.weight", Expected(
                (experts, hidden), f"num_local_experts {experts}, {h}")
            for expert in range(experts):
                mine = f"{at}block_sparse_moe.experts.{expert}."
                yield from {mine + "w1.weight": Expected((ffn, hidden), f"{f}, {h}"),
                            mine + "w3.weight": Expected((ffn, hidden), f"{f}, {h}"),
                            mine + "w2.weight": Expected((hidden, ffn), f"{h}, {f}")}.items()

def _is_mixtral(hf: dict) -> bool:
    return hf.get("model_type") == "mixtral" or \
        "MixtralForCausalLM" in (hf.get("architectures") or [])


LLAMA_HF = LlamaHF()
