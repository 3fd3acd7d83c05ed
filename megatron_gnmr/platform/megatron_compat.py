"""Every difference between the megatron-core releases we support, absorbed in one place.

Supported: 0.16.1 (the newest for Python 3.11) and 0.19.x (what Python 3.12 clusters get).
Nothing outside this module may branch on megatron's version.

Layer specs. The unit linears (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`, and
each expert's fc1/fc2) are swapped in a megatron layer spec for the project's path-routed
subclasses. Up to 0.17 every node of a spec is a `ModuleSpec(module, submodules)`; from 0.18
the MLP and MoE nodes are builders, `functools.partial(MLP.as_mlp_submodule,
submodules=MLPSubmodules(...))` and `partial(MoELayer, submodules=MoESubmodules(...))`, whose
submodules live in the partial's keywords. `submodules_of` reads both forms, so the
replacement below is written once.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

UNIT_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def submodules_of(node: Any) -> Any:
    """The submodules object of a spec node: `ModuleSpec.submodules`, or the `submodules`
    keyword of a builder partial (megatron-core >= 0.18); None for a plain class."""
    if isinstance(node, functools.partial):
        return node.keywords.get("submodules")
    return getattr(node, "submodules", None)


def mlp_submodules(layer_spec: Any) -> Any:
    """The MLPSubmodules holding fc1/fc2 of a layer spec: the dense MLP's, or the routed
    experts' (shared experts are not units)."""
    mlp = submodules_of(submodules_of(layer_spec).mlp)
    experts = getattr(mlp, "experts", None)
    return submodules_of(experts) if experts is not None else mlp


def attention_submodules(layer_spec: Any) -> Any:
    return submodules_of(submodules_of(layer_spec).self_attention)


def replace_unit_linears(layer_spec: Any, replacements: dict[str, type]) -> Any:
    """A copy of `layer_spec` with the unit linears named in `replacements` (keys from
    `UNIT_LINEARS`) built from the given classes."""
    spec = copy.deepcopy(layer_spec)
    attention = attention_submodules(spec)
    for name in ("linear_qkv", "linear_proj"):
        if name in replacements:
            setattr(attention, name, replacements[name])
    mlp = mlp_submodules(spec)
    for name in ("linear_fc1", "linear_fc2"):
        if name in replacements:
            setattr(mlp, name, replacements[name])
    return spec


def unit_linear_classes(layer_spec: Any) -> dict[str, type]:
    """The classes a layer spec builds its unit linears from (for checks and tests)."""
    attention = attention_submodules(layer_spec)
    mlp = mlp_submodules(layer_spec)
    return {**{name: getattr(attention, name) for name in ("linear_qkv", "linear_proj")},
            **{name: getattr(mlp, name) for name in ("linear_fc1", "linear_fc2")}}


def local_layer_spec(num_experts: int | None):
    """megatron's local (no Transformer Engine) LLaMA layer: RMSNorm, per-expert GEMMs."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                    normalization="RMSNorm")


def te_layer_spec(num_experts: int | None):
    """megatron's Transformer Engine layer. Experts stay one TE GEMM each (`SequentialMLP`,
    `moe_grouped_gemm=False`): TE's grouped GEMM runs all local experts in one kernel, so
    one expert could not run BF16 while the others run FP8."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts,
                                                      moe_grouped_gemm=False)
