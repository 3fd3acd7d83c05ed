"""Units: the recoverable operators of a model, in SPEC 2's canonical order.

A unit's global index depends only on the model shape and the `--gnmr-units` regex, never
on the parallel layout: names are built from global layer numbers (megatron's
`TransformerLayer.layer_number`, 1-based), and the eligible list is filtered from the full
canonical list. Each rank then maps the units it owns to its local parameters; units on
other pipeline stages (or, for experts, other expert-parallel ranks) map to nothing and
contribute zero to the statistics.

MoE layers: one unit per expert per fc1/fc2 (`layers.{l}.mlp.experts.{e}.linear_fc1`, with the
global expert index e), after the layer's two attention units and its shared expert's two
(`layers.{l}.mlp.shared_experts.linear_fc1`, if the model has one). Per-expert units keep the
budget meaningful at DeepSeek-V3 scale (256 experts x 61 layers x 2 = 31k units) and let one
hot expert be recovered without its 255 neighbours.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from megatron_gnmr.errors import UserError
from megatron_gnmr.model_families.llama import ATTENTION_LINEARS
from megatron_gnmr.platform.megatron_compat import MLP_LINEARS

# Norm parameters that Transformer Engine fuses into the linear after the norm
# (`TELayerNormColumnParallelLinear.layer_norm_weight` in the attention's input projection and
# in `linear_fc1`). They are not part of the unit: the same model must give the same unit
# norms with the local spec (separate RMSNorm modules) and the TE spec. They still count in
# the global norm.
FUSED_NORM_PARAMETERS = ("layer_norm_weight", "layer_norm_bias")

# Per decoder layer, in canonical order (SPEC 2): the attention's unit linears (the model
# family's, `model_families/`), its core attention where that is a unit, then the MLP's.
CORE_ATTENTION_SUFFIX = "self_attention.core_attention"
MLP_UNIT_SUFFIXES = tuple(f"mlp.{name}" for name in MLP_LINEARS)


@dataclass(frozen=True)
class UnitShape:
    """What decides a model's unit names: its layers, experts, shared expert and leading
    dense layers (DeepSeek's first_k_dense_replace)."""

    num_layers: int
    num_experts: int | None = None
    shared_experts: bool = False
    first_dense_layers: int = 0
    core_attention: bool = False
    """Each layer's core attention is a unit too (low-precision attention is switchable:
    `precision/attention_unit.py`), between the input projections and the output one."""
    attention_linears: tuple[str, ...] = ATTENTION_LINEARS
    """The attention's unit linears in canonical order, output projection last (the model
    family's; LLaMA's by default)."""

    @classmethod
    def of(cls, config, core_attention: bool = False) -> "UnitShape":
        """The shape of a `RunConfig`'s model."""
        from megatron_gnmr.model_families import family_of

        model = config.model
        linears = tuple(linear.name for linear in family_of(config).attention_linears(config))
        return cls(model.num_layers, model.num_experts,
                   bool(model.moe_shared_expert_intermediate_size),
                   model.moe_first_dense_layers if model.num_experts else 0, core_attention,
                   linears)

    @classmethod
    def of_run(cls, config) -> "UnitShape":
        """The shape of a `RunConfig`'s model, with its core attention a unit when the run's
        attention has a low-cost path."""
        from megatron_gnmr.precision.attention_unit import switchable_attention

        return cls.of(config, switchable_attention(config))

    def attention_suffixes(self) -> tuple[str, ...]:
        linears = tuple(f"self_attention.{name}" for name in self.attention_linears)
        if not self.core_attention:
            return linears
        return (*linears[:-1], CORE_ATTENTION_SUFFIX, linears[-1])

    def layer_suffixes(self, layer: int) -> tuple[str, ...]:
        """Unit names inside decoder layer `layer` (0-based), in canonical order."""
        if not self.num_experts or layer < self.first_dense_layers:
            return (*self.attention_suffixes(), *MLP_UNIT_SUFFIXES)
        shared = (tuple(f"mlp.shared_experts.{name}" for name in MLP_LINEARS)
                  if self.shared_experts else ())
        return (*self.attention_suffixes(), *shared,
                *(f"mlp.experts.{expert}.{name}" for expert in range(self.num_experts)
                  for name in MLP_LINEARS))

    def names(self) -> list[str]:
        return [f"layers.{layer}.{suffix}" for layer in range(self.num_layers)
                for suffix in self.layer_suffixes(layer)]


UNIT_KINDS = ("attention", "dense MLP", "shared expert", "routed experts")


def unit_kind(name: str) -> str:
    """Which of UNIT_KINDS a unit name belongs to."""
    if ".self_attention." in name:
        return "attention"
    if ".mlp.experts." in name:
        return "routed experts"
    if ".mlp.shared_experts." in name:
        return "shared expert"
    return "dense MLP"


def canonical_unit_names(num_layers: int, num_experts: int | None = None,
                         shared_experts: bool = False) -> list[str]:
    return UnitShape(num_layers, num_experts, shared_experts).names()


def eligible_unit_names(shape: UnitShape, pattern: str, keep=None) -> list[str]:
    """The units `pattern` matches (and `keep(name)` accepts: LoRA's adapted linears, the only
    units with gradients in a LoRA run)."""
    try:
        regex = re.compile(pattern)
    except re.error as error:
        raise UserError(f"--gnmr-units {pattern!r}: not a valid regex ({error})") from None
    names = [name for name in shape.names() if regex.search(name) and (keep is None
                                                                        or keep(name))]
    if not names:
        raise UserError(f"--gnmr-units {pattern!r} matches no unit (names look like "
                        "'layers.0.mlp.linear_fc1'"
                        + ("; with --lora, only the adapted linears are units)" if keep else ")"))
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
        """This rank's parameters of the unit (its GEMM weights; see FUSED_NORM_PARAMETERS)."""
        module = self.modules.get(unit)
        if module is None:
            return []
        return [param for name, param in module.named_parameters()
                if name not in FUSED_NORM_PARAMETERS]


def _unit_module(layer: torch.nn.Module, suffix: str) -> torch.nn.Module | None:
    """The module of a unit inside a TransformerLayer, or None if another EP rank owns it."""
    parts = suffix.split(".")
    if parts[:2] != ["mlp", "experts"]:
        return layer.get_submodule(suffix)
    from megatron.core import parallel_state

    experts = layer.mlp.experts  # megatron SequentialMLP: `local_experts` of this EP rank
    first = parallel_state.get_expert_model_parallel_rank() * experts.num_local_experts
    local = int(parts[2]) - first
    if not 0 <= local < experts.num_local_experts:
        return None
    return experts.local_experts[local].get_submodule(parts[3])


def build_registry(model_chunks: list[torch.nn.Module], shape: UnitShape,
                   pattern: str, keep=None) -> UnitRegistry:
    """Find this rank's modules for every eligible unit."""
    registry = UnitRegistry(eligible_unit_names(shape, pattern, keep))
    position = {name: i for i, name in enumerate(registry.names)}
    for chunk in model_chunks:
        for module in chunk.modules():
            layer_number = getattr(module, "layer_number", None)
            if layer_number is None or not hasattr(module, "mlp"):
                continue  # not a TransformerLayer
            for suffix in shape.layer_suffixes(layer_number - 1):
                name = f"layers.{layer_number - 1}.{suffix}"
                if name in position:
                    unit_module = _unit_module(module, suffix)
                    if unit_module is not None:
                        registry.modules[position[name]] = unit_module
    return registry


def local_unit_modules(model_chunks: list[torch.nn.Module], shape: UnitShape) -> dict:
    """Every unit (eligible or not) that lives on this rank, by name."""
    registry = build_registry(model_chunks, shape, ".")
    return {registry.names[index]: module for index, module in registry.modules.items()}
