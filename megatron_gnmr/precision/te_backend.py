"""The `te-fp8` recipe: Transformer Engine FP8 linears that drop to BF16 per unit and step.

Megatron builds the layers from its TE spec and enters TE's FP8 autocast around each layer
(`fp8_utils.get_fp8_context`, from `TransformerConfig.fp8` / `fp8_recipe`). The unit linears
are built from subclasses of megatron's TE linears (`switchable`), whose forward runs inside
a nested, *disabled* autocast while the plan recovers the unit: the inner context wins, TE
re-reads the FP8 state on every forward, and a module's backward inherits its forward's
setting (`ctx.fp8`), so the switch is per unit, per step, with forward and backward
consistent. Delayed scaling is refused: a unit that skips FP8 for a step would skip its
amax-history update.

Experts stay one TE GEMM each (`megatron_compat.te_layer_spec`), so each expert is a unit
that switches alone. Written against TE's public API: `te.autocast(enabled=...)` (TE >= 2.9;
a function to 2.15, a class of the same call from 2.16; `fp8_autocast` deprecated), else
`te.fp8_autocast(enabled=...)`. Read in TE 2.9, 2.11, 2.18 and the 2.19.0 / 2.20.2 release
wheels, never run (setup.py's `te` extra: on Python 3.11 megatron-core 0.16.1's own bound,
<2.12; on 3.12 <2.21). Only imported where TE is.
"""

from __future__ import annotations

import functools

from megatron_gnmr.errors import UserError
from megatron_gnmr.platform import capabilities
from megatron_gnmr.precision.gemm_shapes import shape_problems, unit_gemms

FP8_RECIPES = ("tensorwise", "blockwise", "mxfp8")
# (tokens, K, N) multiples per recipe: TE's own asserts (see gemm_shapes.py).
SHAPE_RULES = {"tensorwise": (8, 16, 8), "blockwise": (8, 16, 8), "mxfp8": (32, 32, 32)}


def check_fp8_recipe(fp8_recipe: str) -> None:
    """The --fp8-recipe values every FP8 recipe shares (emulated or real; --fp8-format's are
    precision/config.py's)."""
    if fp8_recipe == "delayed":
        raise UserError("--fp8-recipe delayed is refused: per-unit switching would skip amax "
                        "history updates of recovered units; use tensorwise, blockwise or mxfp8")
    if fp8_recipe not in FP8_RECIPES:
        raise UserError(f"--fp8-recipe {fp8_recipe!r}: use tensorwise, blockwise or mxfp8")


def validate_te_fp8(config) -> None:
    """te-fp8: flags, Transformer Engine, this GPU's support for the recipe, GEMM shapes."""
    precision = config.precision
    check_fp8_recipe(precision.fp8_recipe)
    te = capabilities.transformer_engine()
    if not te:
        fmt = precision.fp8_format or "hybrid"
        raise UserError(f"FP8 through Transformer Engine (--precision-recipe te-fp8, which "
                        f"--fp8-format {fmt} alone means, as in Megatron-LM) needs Transformer "
                        f"Engine: {te.reason}; to emulate it here: --precision-recipe "
                        f"fp8-emulated --fp8-format {fmt}")
    support = capabilities.te_recipe(precision.fp8_recipe)
    if not support:
        others = [r for r in FP8_RECIPES if r != precision.fp8_recipe
                  and capabilities.te_recipe(r)]
        hint = f"use --fp8-recipe {' or '.join(others)}" if others else \
            "this GPU runs no TE FP8 recipe; use --precision-recipe fp8-emulated"
        raise UserError(f"--fp8-recipe {precision.fp8_recipe}: Transformer Engine says "
                        f"\"{support.reason}\"; {hint}")
    problems = shape_problems(unit_gemms(config), *SHAPE_RULES[precision.fp8_recipe])
    if problems:
        raise UserError(f"--precision-recipe te-fp8 --fp8-recipe {precision.fp8_recipe}: "
                        f"{problems[0]}" + (f" (and {len(problems) - 1} more)"
                                            if len(problems) > 1 else "")
                        + "; change --hidden-size/--ffn-hidden-size/--micro-batch-size/"
                          "--seq-length or the TP size")


def disabled_fp8_autocast():
    te = capabilities.te_module()
    if hasattr(te, "autocast"):
        return te.autocast(enabled=False)
    return te.fp8_autocast(enabled=False)


class _RecoverySwitch:
    """Runs the TE linear in BF16 (FP8 autocast disabled) while its unit is recovered."""

    unit_name: str | None = None
    precision_runtime = None

    def forward(self, *args, **kwargs):
        runtime = self.precision_runtime
        if runtime is not None and runtime.plan.is_recovery(self.unit_name):
            with disabled_fp8_autocast():
                return super().forward(*args, **kwargs)
        return super().forward(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def switchable(te_linear: type) -> type:
    """A subclass of one of megatron's TE linears that switches per unit."""
    return type(f"Switchable{te_linear.__name__}", (_RecoverySwitch, te_linear), {})


def switchable_layer_spec(spec, family):
    """The TE layer spec with every unit linear switchable (fused-norm linears included)."""
    from megatron_gnmr.model_families import route_unit_linears

    return route_unit_linears(spec, family, switchable)
