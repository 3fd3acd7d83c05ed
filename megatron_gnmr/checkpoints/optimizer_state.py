"""The optimizer's part of a checkpoint shard.

megatron's optimizers return their whole state from `state_dict()`, except the distributed
optimizer: its per-parameter state (Adam moments and, with bf16, the fp32 main weights)
lives in shards, one per data-parallel rank, and megatron saves it through separate,
collective calls (`save_parameter_state`, gathering onto one rank, or its distributed
checkpoint format). A shard of this project's checkpoint belongs to one rank and one fixed
layout (checked on resume), so each rank simply keeps its own shards: the inner torch
optimizer's state and the main-weight shards, next to megatron's `state_dict()`.
"""

from __future__ import annotations

import torch

from megatron_gnmr.platform.megatron_compat import distributed_optimizer_parts


def optimizer_state(optimizer) -> dict:
    state = {"megatron": optimizer.state_dict()}
    parts = distributed_optimizer_parts(optimizer)
    if parts:
        state["shards"] = [{"inner": part.optimizer.state_dict(),
                            "main_weights": [w.detach().clone() for w in _main_weights(part)]}
                           for part in parts]
    return state


@torch.no_grad()
def load_optimizer_state(optimizer, state: dict) -> None:
    optimizer.load_state_dict(state["megatron"])
    parts = distributed_optimizer_parts(optimizer)
    saved = state.get("shards", [])
    if len(saved) != len(parts):
        raise ValueError(f"the checkpoint holds {len(saved)} distributed-optimizer shards, "
                         f"this run has {len(parts)} (--use-distributed-optimizer differs?)")
    for part, shard in zip(parts, saved):
        part.optimizer.load_state_dict(shard["inner"])
        weights = _main_weights(part)
        if len(weights) != len(shard["main_weights"]):
            raise ValueError("the distributed optimizer's main-weight shards do not match")
        for weight, value in zip(weights, shard["main_weights"]):
            weight.copy_(value)


def _main_weights(part) -> list[torch.Tensor]:
    """The fp32 main-weight shards of bf16 parameters (fp32 parameters' shards are views of
    the model's own weights, saved with the model)."""
    return [w for group in part.shard_fp32_from_float16_groups for w in group]
