"""Transformer Engine's `_extra_state` never travels through a checkpoint, in either format:
it is written as TE's own "no FP8 state" (an empty uint8 tensor, or left out) and, whatever a
file holds, every module is given that empty tensor on load. No pickle of it is unpickled.

Why: a TE module's `get_extra_state()` is a uint8 tensor of `pickle.dumps({"recipe": ...,
"extra_fp8_variables": {...}, ...})`, and `set_extra_state` calls `pickle.loads` on any
non-empty one: TE 2.9 to 2.17 (`transformer_engine/pytorch/module/base.py`) with no check at
all; 2.18 added `should_load_extra_state_pickle` (it refuses a payload it cannot classify
unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE is set). megatron-core's TEGroupedLinear load hook
(`merge_extra_states`, 0.16.1) unpickles `_extra_state<i>` itself. Reading a file with
`weights_only=True` lets such a byte tensor through (it is a tensor), so a crafted checkpoint
would run code at `load_state_dict`. torch_dist saves it as a ShardedObject per module; the
per-rank torch format would hand it over from the shard.

Why nothing is lost: the recipes this project allows (tensorwise, blockwise, mxfp8; delayed
scaling is refused, `precision/te_backend.py`) keep no scaling state between steps. Their
extra state is the recipe object and a few flags, which the live module already holds from
the run's own flags (TE 2.18 itself writes an empty tensor for them: `is_stateless_recipe`).
An empty tensor is what every TE 2.x `set_extra_state` returns on before any unpickling, and
what megatron's own local linears ignore (theirs is None). Megatron-LM's loader still finds
every `_extra_state` key it asks for in a torch_dist checkpoint (empty, as TE >= 2.18 writes).
"""

from __future__ import annotations

import dataclasses
import re

import torch

# `_extra_state`, and TEGroupedLinear's per-GEMM `_extra_state1`, `_extra_state2`, ...
EXTRA_STATE = re.compile(r"(^|\.)_extra_state\d*$")


def is_extra_state(key: str) -> bool:
    return EXTRA_STATE.search(key) is not None


def no_fp8_state() -> torch.Tensor:
    """TE's marker for "this module has no FP8 state" (`set_extra_state` returns on it)."""
    return torch.empty(0, dtype=torch.uint8)


def written_empty(sharded_model: dict) -> dict:
    """megatron's sharded model state for a save, every extra state replaced by TE's empty
    marker (the live module's pickle is never written)."""
    return {key: dataclasses.replace(value, data=no_fp8_state())
            if is_extra_state(key) and dataclasses.is_dataclass(value) else value
            for key, value in sharded_model.items()}


def not_read(sharded_model: dict) -> dict:
    """megatron's sharded model state for a load, without its extra states: what a file holds
    there (an older checkpoint's pickle, a crafted one) is never read."""
    return {key: value for key, value in sharded_model.items() if not is_extra_state(key)}


def without_extra_state(state: dict) -> dict:
    """A plain model state dict without extra states (the per-rank torch format's shard)."""
    return {key: value for key, value in state.items() if not is_extra_state(key)}


def loadable(module: torch.nn.Module, state: dict) -> dict:
    """`state` for `module.load_state_dict`: its weights, and for every extra state the module
    has (its keys as its own `state_dict` names them: a wrapper such as megatron's DDP gives
    its inner module's), TE's empty marker in place of whatever `state` held."""
    return {**without_extra_state(state),
            **{key: no_fp8_state() for key in module.state_dict() if is_extra_state(key)}}
