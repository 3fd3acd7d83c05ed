"""Units: the recoverable operators of a model, in SPEC 2's canonical order.

A unit's global index depends only on the model shape and the `--gnmr-units` regex, never
on the parallel layout: names are built from global layer numbers (megatron's
`TransformerLayer.layer_number`, 1-based), and the eligible list is filtered from the full
canonical list. Each rank then maps the units it owns to its local parameters; units on
other pipeline stages map to nothing and contribute zero to the statistics.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from megatron_gnmr.errors import UserError

# Per decoder layer, in canonical order (SPEC 2).
DENSE_UNIT_SUFFIXES = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


def canonical_unit_names(num_layers: int) -> list[str]:
    return [f"layers.{layer}.{suffix}" for layer in range(num_layers)
            for suffix in DENSE_UNIT_SUFFIXES]


def eligible_unit_names(num_layers: int, pattern: str) -> list[str]:
    try:
        regex = re.compile(pattern)
    except re.error as error:
        raise UserError(f"--gnmr-units {pattern!r}: not a valid regex ({error})") from None
    names = [name for name in canonical_unit_names(num_layers) if regex.search(name)]
    if not names:
        raise UserError(f"--gnmr-units {pattern!r} matches no unit (names look like "
                        f"'layers.0.mlp.linear_fc1')")
    return names


@dataclass
class UnitRegistry:
    """The eligible units (global, canonical order) and this rank's modules for them."""

    names: list[str]
    modules: dict[int, torch.nn.Module] = field(default_factory=dict)

    @property
    def num_units(self) -> int:
        return len(self.names)

    def index(self, name: str) -> int:
        return self.names.index(name)

    def local_parameters(self, unit: int) -> list[torch.nn.Parameter]:
        module = self.modules.get(unit)
        return [] if module is None else list(module.parameters())


def build_registry(model_chunks: list[torch.nn.Module], num_layers: int,
                   pattern: str, missing_ok: bool = False) -> UnitRegistry:
    """Find this rank's modules for every eligible unit (`missing_ok`: skip units a layer
    does not have, e.g. the dense MLP of an MoE layer)."""
    registry = UnitRegistry(eligible_unit_names(num_layers, pattern))
    position = {name: i for i, name in enumerate(registry.names)}
    for chunk in model_chunks:
        for module in chunk.modules():
            layer_number = getattr(module, "layer_number", None)
            if layer_number is None or not hasattr(module, "mlp"):
                continue  # not a TransformerLayer
            for suffix in DENSE_UNIT_SUFFIXES:
                name = f"layers.{layer_number - 1}.{suffix}"
                if name in position:
                    try:
                        registry.modules[position[name]] = module.get_submodule(suffix)
                    except AttributeError:
                        if not missing_ok:
                            raise
    return registry


def local_unit_modules(model_chunks: list[torch.nn.Module], num_layers: int) -> dict:
    """Every unit (eligible or not) that lives on this rank, by name."""
    registry = build_registry(model_chunks, num_layers, pattern=".", missing_ok=True)
    return {registry.names[index]: module for index, module in registry.modules.items()}
