"""Per-head W_q and W_k out of megatron's fused QKV weight.

megatron's `linear_qkv.weight` (ColumnParallelLinear, `[out, d_model]`) is interleaved per
query group, not [all Q; all K; all V]: for each query group g held by this TP rank the rows
are

    [ q rows of the group's heads (heads_per_group * d_head) | k rows (d_head) | v rows (d_head) ]

(`SelfAttention.get_query_key_value_tensors` splits the projection the same way). Under TP
each rank holds `num_query_groups / tp` whole groups, so its query heads and their key
heads are local: GQA pairing never crosses ranks. Returned matrices are d_model x d_head,
the orientation of SPEC 7.1 (A = W_q^h is the map from the residual stream to head h).
"""

from __future__ import annotations

import torch


def split_qkv(weight: torch.Tensor, heads_per_group: int, d_head: int):
    """(queries [local heads, d_model, d_head], keys [local groups, d_model, d_head],
    group_of_head [local heads])."""
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


def query_and_key_matrices(weight: torch.Tensor, heads_per_group: int, d_head: int):
    """Full local W_q and W_k as [heads * d_head, d_model] (rows as in a linear weight)."""
    queries, keys, _ = split_qkv(weight, heads_per_group, d_head)
    return (queries.transpose(1, 2).reshape(-1, weight.shape[1]),
            keys.transpose(1, 2).reshape(-1, weight.shape[1]))
