"""The `te-fp8` recipe: Transformer Engine FP8 linears that drop to BF16 per unit and step.

Megatron builds the layers from its TE spec and enters TE's FP8 autocast around each layer
(`fp8_utils.get_fp8_context`, from `TransformerConfig.fp8` / `fp8_recipe`). A unit on the
recovery path runs its module's forward inside a nested, *disabled* autocast: the inner
context wins, TE re-reads the FP8 state on every forward, and a module's backward inherits
its forward's setting, so the switch is per unit, per step, with forward and backward
consistent. Delayed scaling is refused (`recipes._fp8_granularity`): a unit that skips FP8
for a step would skip its amax history update.

Written against TE's public API: `te.autocast(enabled=...)` (TE >= 2.9), falling back to
`te.fp8_autocast(enabled=...)` on older TE; recipes from `transformer_engine.common.recipe`.
Only imported where `capabilities.transformer_engine()` is true.
"""

from __future__ import annotations

import functools

from megatron_gnmr.platform import capabilities

# Megatron's --fp8-recipe names -> megatron TransformerConfig.fp8_recipe values.
MEGATRON_FP8_RECIPE = {"tensorwise": "tensorwise", "blockwise": "blockwise", "mxfp8": "mxfp8"}


def disabled_fp8_autocast():
    te = capabilities.te_module()
    if hasattr(te, "autocast"):
        return te.autocast(enabled=False)
    return te.fp8_autocast(enabled=False)


def te_recipe(precision_config):
    """The TE recipe object for the flags (what megatron builds from the same config)."""
    from transformer_engine.common import recipe

    fmt = recipe.Format.HYBRID if precision_config.fp8_format == "hybrid" else recipe.Format.E4M3
    if precision_config.fp8_recipe == "tensorwise":
        return recipe.Float8CurrentScaling(fp8_format=fmt)
    if precision_config.fp8_recipe == "blockwise":
        return recipe.Float8BlockScaling(fp8_format=fmt)
    return recipe.MXFP8BlockScaling(fp8_format=fmt)


def bind_te_units(unit_modules: dict[str, object], plan) -> None:
    """Wrap each unit's TE module so it runs in BF16 whenever the plan recovers it."""
    for name, module in unit_modules.items():
        original = module.forward

        @functools.wraps(original)
        def forward(*args, _original=original, _name=name, **kwargs):
            if plan.is_recovery(_name):
                with disabled_fp8_autocast():
                    return _original(*args, **kwargs)
            return _original(*args, **kwargs)

        module.forward = forward
