"""`--log-throughput`: the model's FLOPs per training step by Megatron-LM's formula
(`megatron/training/training.py:num_floating_point_operations` at core_v0.16.1, its
transformer branch: dense and MoE MLPs, grouped-query or multi-latent attention with a causal
half of the scores, the logits; forward and backward = 3x, a multiply-add = 2 FLOPs), so a
TFLOP/s figure compares with a Megatron-LM log line for line."""

from __future__ import annotations

FORWARD_BACKWARD, FMA = 3, 2


def _attention_term(config) -> float:
    m, s = config.model, config.model.seq_length
    h, heads = m.hidden_size, m.num_attention_heads
    if m.model_family == "deepseek-mla":
        a = config.mla
        rope_qk = a.qk_head_dim + a.qk_pos_emb_head_dim
        q_term = h * heads * rope_qk if a.q_lora_rank is None else \
            a.q_lora_rank * (h + heads * rope_qk + 1)
        return FORWARD_BACKWARD * FMA * (
            q_term + a.kv_lora_rank * (h + heads * (a.qk_head_dim + a.v_head_dim) + 1)
            + h * a.qk_pos_emb_head_dim + heads * a.v_head_dim * h
            + s * heads * rope_qk / 2 + s * heads * a.v_head_dim / 2)
    d_head = m.kv_channels or h // heads
    query = d_head * heads
    key_value = 2 * d_head * (m.num_query_groups or heads)
    return FORWARD_BACKWARD * FMA * (h * (query + key_value) + query * s / 2 * 2 + query * h)


def step_flops(config, padded_vocab_size: int) -> float:
    """FLOPs of one optimizer step (the whole global batch, all ranks together)."""
    m, t = config.model, config.training
    swiglu = 3  # the families' MLPs are SwiGLU: three h x ffn GEMMs
    moe_layers = m.num_layers - m.moe_first_dense_layers if m.num_experts else 0
    dense_layers = m.num_layers - moe_layers
    mlp = (m.ffn_hidden_size * swiglu * dense_layers
           + ((m.moe_ffn_hidden_size or m.ffn_hidden_size) * m.moe_router_topk
              + (m.moe_shared_expert_intermediate_size or 0)) * swiglu * moe_layers)
    per_token = (FORWARD_BACKWARD * FMA * m.hidden_size * mlp
                 + _attention_term(config) * m.num_layers
                 + FORWARD_BACKWARD * FMA * m.hidden_size * padded_vocab_size)
    return t.global_batch_size * m.seq_length * per_token
