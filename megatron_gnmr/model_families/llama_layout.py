"""The LLaMA family's weight layout, shared by the family (`llama.py`) and its Hugging Face
mapping (`llama_hf.py`), which reads and writes the separate Q, K and V projections.

megatron's `linear_qkv.weight` (`[out, d_model]`) is interleaved per query group, not
[all Q; all K; all V]: for each query group g the rows are

    [ q rows of the group's heads (heads_per_group * d_head) | k rows (d_head) | v rows (d_head) ]

(`SelfAttention.get_query_key_value_tensors` splits the projection the same way).
"""

from __future__ import annotations

import torch

QKV, PROJ = "linear_qkv", "linear_proj"
ATTENTION_LINEARS = (QKV, PROJ)


def head_dim(model) -> int:
    """Each head's width: --kv-channels, else d_model / heads (Megatron-LM's rule)."""
    return model.kv_channels or model.hidden_size // model.num_attention_heads


def unfused_qkv(weight: torch.Tensor, model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The full (unsharded) fused QKV weight as the separate Q, K and V projections, heads in
    order ([heads * d_head, d_model], [groups * d_head, d_model] twice): the layout above
    (Hugging Face's q_proj, k_proj, v_proj)."""
    heads, d_head = model.num_attention_heads, head_dim(model)
    groups = model.num_query_groups or heads
    per = heads // groups
    grouped = weight.reshape(groups, per + 2, d_head, -1)
    return (grouped[:, :per].reshape(heads * d_head, -1),
            grouped[:, per].reshape(groups * d_head, -1),
            grouped[:, per + 1].reshape(groups * d_head, -1))


def fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model) -> torch.Tensor:
    """The inverse of `unfused_qkv`."""
    heads, d_head = model.num_attention_heads, head_dim(model)
    groups = model.num_query_groups or heads
    width = q.shape[-1]
    return torch.cat([q.reshape(groups, heads // groups, d_head, width),
                      k.reshape(groups, 1, d_head, width), v.reshape(groups, 1, d_head, width)],
                     dim=1).reshape((heads + 2 * groups) * d_head, width)
