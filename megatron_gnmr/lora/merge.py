"""Merging LoRA adapters into their base weights, shard by shard (Megatron-Bridge's
`LoRAMerge`, without a process group: every TP shard is at hand on disk).

    W' = W + (alpha / r) B A

Column-parallel base (W: [N/tp, K]): A is split along r, so W' = W + s B_local A_full with
A_full the TP shards of A stacked. Row-parallel base (W: [N, K/tp]): B is split along N, so
W' = W + s B_full A_local. The product is taken in float64 and W' stored in W's dtype.
"""

from __future__ import annotations

import torch

ADAPTER_IN, ADAPTER_OUT = ".adapter.linear_in.weight", ".adapter.linear_out.weight"


def adapted_prefixes(state: dict) -> list[str]:
    """`...linear_fc1` for every adapter in a model state."""
    return [key[: -len(ADAPTER_IN)] for key in state if key.endswith(ADAPTER_IN)]


def merge_shard(state: dict, adapters: list[dict], tp_rank: int, scale: float,
                row_parallel: set[str]) -> dict:
    """TP rank `tp_rank`'s merged model state: its base weights (`state`) plus every
    adapter's update, the adapter entries removed. `adapters`: the adapter states of its
    whole TP group (index = TP rank); `row_parallel`: the names of the model's row-parallel
    linears (their adapters' shards split the other way)."""
    own = adapters[tp_rank]
    out = {k: v for k, v in state.items() if ".adapter." not in f".{k}"}
    for prefix in adapted_prefixes(own):
        if prefix.rsplit(".", 1)[-1] in row_parallel:
            b = torch.cat([a[prefix + ADAPTER_OUT] for a in adapters], dim=0)
            a_ = own[prefix + ADAPTER_IN]
        else:
            b = own[prefix + ADAPTER_OUT]
            a_ = torch.cat([a[prefix + ADAPTER_IN] for a in adapters], dim=0)
        weight = state[prefix + ".weight"]
        update = scale * (b.double() @ a_.double())
        out[prefix + ".weight"] = (weight.double() + update).to(weight.dtype)
    return out


def merge_group(base: list[dict], adapters: list[dict], scale: float,
                row_parallel: set[str]) -> list[dict]:
    """One TP group's merged model states (index = TP rank), every shard at hand."""
    return [merge_shard(state, adapters, rank, scale, row_parallel)
            for rank, state in enumerate(base)]
