"""The precision backends (`--precision-recipe`): the registry.

A backend says how a run's unit linears are built (the layer spec), which pair of paths they
switch between (the recipe, for the path-routed linears; None for a backend that switches
by its own means, as TE does), what it checks up front, which megatron `TransformerConfig`
fields it sets, whether the qerr/oracle probes can measure its low path, and whether it runs
MoE models. Adding a backend is one file (its recipe or spec) and one entry here; checks ask
a backend for these capabilities instead of naming it (`gpu_check/check.py` names the
backends it exercises on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron_gnmr.errors import UserError
from megatron_gnmr.precision import recipes


@dataclass(frozen=True)
class Backend:
    recipe: Callable | None
    """PrecisionConfig -> Recipe (low and recovery paths of the path-routed linears)."""
    layer_spec: Callable[[object, object, int | None], object] | None = None
    """(model family, RunConfig, num_experts) -> megatron layer spec; None: the family's local
    spec with path-routed linears."""
    validate: Callable | None = None
    """RunConfig -> None (raises UserError): checks before anything is built."""
    megatron_fields: Callable = lambda precision: {}
    """PrecisionConfig -> TransformerConfig fields (TE's FP8 settings)."""
    probes: bool = True
    """The precision probes can measure its low path (`--gnmr-signals qerr`)."""
    experts: bool = False
    """It may run MoE models."""
    start_note: Callable | None = None
    """(RunConfig, world_size) -> a line for the user at the start of a run, or None."""
    options: tuple[str, ...] = ()
    """The PrecisionConfig fields it reads; another backend's, set away from their default,
    are refused (`inapplicable_options`)."""
    per_gemm_recovery: bool = True
    """A unit's fprop, dgrad and wgrad GEMMs can take the recovery path one by one
    (`--precision-recovery-gemms`; the emulated kernels)."""
    transformer_engine_layers: bool = False
    """Its layers are Transformer Engine's (their attention kernels, their fused norms)."""

    @property
    def quantizes(self) -> bool:
        """Whether anything runs in low precision (False: megatron's own linears)."""
        return self.recipe is not None or self.layer_spec is not None


def _te_spec(family, config, num_experts):
    from megatron_gnmr.precision.te_backend import switchable_layer_spec

    return switchable_layer_spec(family.te_layer_spec(config, num_experts), family)


def _te_validate(config):
    from megatron_gnmr.precision.te_backend import validate_te_fp8

    validate_te_fp8(config)


def _te_layers(family, config, num_experts):
    return family.te_layer_spec(config, num_experts)


def _te_layers_validate(config):
    from megatron_gnmr.platform import capabilities

    te = capabilities.transformer_engine()
    if not te:
        raise UserError(f"--transformer-impl transformer_engine needs Transformer Engine: "
                        f"{te.reason}; use --transformer-impl local")


def _torchao_validate(config):
    from megatron_gnmr.precision.gemm_shapes import shape_problems, unit_gemms
    from megatron_gnmr.precision.torchao_compat import require_torchao

    require_torchao()
    problems = shape_problems(unit_gemms(config), 16, 16, 16)
    if problems:
        raise UserError("--precision-recipe fp8-torchao: torch._scaled_mm needs every GEMM "
                        f"dimension to be a multiple of 16; {problems[0]}"
                        + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


def _torchao_start_note(config, world_size: int) -> str | None:
    """On a CPU, what torch's float8 GEMMs will cost (measured here, a fraction of a second):
    on some CPUs they are a reference kernel, hundreds of times slower than float32."""
    from megatron_gnmr.platform.device import has_accelerator

    if has_accelerator():
        return None
    from megatron_gnmr.precision.float8_speed import measure
    from megatron_gnmr.precision.gemm_shapes import step_macs

    speed = measure()
    seconds = step_macs(config, world_size) / speed.float8_macs_per_s
    return (f"fp8-torchao on this CPU: {speed.describe()}; this model's unit GEMMs alone will "
            f"take about {seconds:,.1f} s per step. --precision-recipe fp8-emulated computes "
            "tensorwise FP8's numerics (the same E4M3/E5M2 operands, float32 GEMMs) at about "
            "float32 speed")


FP8_OPTIONS = ("fp8_format", "fp8_recipe")
BACKENDS = {
    "none": Backend(recipe=None, probes=False, experts=True),
    "fp8-emulated": Backend(recipes.fp8_emulated, experts=True,
                            options=(*FP8_OPTIONS, "moe_dispatch_quant")),
    "deepseek": Backend(recipes.deepseek, experts=True,
                        options=("deepseek_low_format", "moe_dispatch_quant")),
    "nvfp4": Backend(recipes.nvfp4, experts=True, options=(
        "nvfp4_recovery", "nvfp4_2d_weights", "nvfp4_stochastic_rounding", "nvfp4_hadamard")),
    "act-quant": Backend(recipes.act_quant, experts=True, options=(
        "act_quant_bits", "act_quant_recovery_bits", "act_quant_granularity")),
    "w8a8": Backend(recipes.w8a8, experts=True,
                    options=("int_weight_bits", "int_activation_bits")),
    "fp8-torchao": Backend(recipes.fp8_torchao, validate=_torchao_validate,
                           start_note=_torchao_start_note, options=FP8_OPTIONS,
                           per_gemm_recovery=False),
    # Transformer Engine's layers in BF16 (Megatron-LM's --transformer-impl transformer_engine
    # without --fp8-format): nothing switches.
    "te": Backend(recipe=None, layer_spec=_te_layers, validate=_te_layers_validate,
                  probes=False, experts=True, per_gemm_recovery=False,
                  transformer_engine_layers=True),
    # Our --fp8-format / --fp8-recipe values are megatron's own.
    "te-fp8": Backend(recipe=None, layer_spec=_te_spec, validate=_te_validate,
                      megatron_fields=lambda p: {"fp8": p.fp8_format or "hybrid",
                                                 "fp8_recipe": p.fp8_recipe},
                      probes=False, experts=True, options=FP8_OPTIONS,
                      per_gemm_recovery=False, transformer_engine_layers=True),
}


def backend(precision) -> Backend:
    """The backend of a PrecisionConfig, or a UserError naming the known ones."""
    try:
        return BACKENDS[precision.precision_recipe]
    except KeyError:
        raise UserError(f"--precision-recipe {precision.precision_recipe!r}: use one of "
                        f"{', '.join(BACKENDS)}") from None


def build_recipe(precision) -> recipes.Recipe | None:
    """The path pair of the run's path-routed linears (None: nothing to route)."""
    chosen = backend(precision)
    return chosen.recipe(precision) if chosen.recipe is not None else None


def inapplicable_options(precision) -> list[str]:
    """The recipe options set away from their default that the run's backend does not read
    (`fp8_format`, ... as field names), in field order. With `none` nothing is quantized and
    every option is inert: a baseline switches the recipe off without editing its config."""
    import dataclasses

    if precision.precision_recipe == "none":
        return []
    chosen = backend(precision)
    others = {name for entry in BACKENDS.values() for name in entry.options} - \
        set(chosen.options)
    return [f.name for f in dataclasses.fields(precision)
            if f.name in others and getattr(precision, f.name) != f.default]
