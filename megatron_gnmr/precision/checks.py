"""The precision section's checks that need more than one field (and the model's layer count
or the attention fault's training settings, where a precision setting depends on them): every
failure a UserError naming the flag, raised before anything is built. Single-field rules are
limits on the fields (`precision/config.py`); a precision config file is read against the
model's units in validation.py (it needs the controller's unit names)."""

from __future__ import annotations

from megatron_gnmr.errors import UserError


def check_precision(config) -> None:
    from megatron_gnmr.precision.backends import backend, build_recipe

    precision = config.precision
    build_recipe(precision)  # raises a UserError naming the flag
    from megatron_gnmr.precision.backends import BACKENDS, inapplicable_options

    for name in inapplicable_options(precision):
        users = [recipe for recipe, entry in BACKENDS.items() if name in entry.options]
        flag = name.replace("_", "-")
        flag = f"--no-{flag}" if getattr(precision, name) is False else f"--{flag}"
        raise UserError(f"{flag} applies to --precision-recipe "
                        f"{' or '.join(users)} only; this run uses "
                        f"{precision.precision_recipe}, which would ignore it")
    if precision.transformer_impl == "transformer_engine" and \
            not backend(precision).transformer_engine_layers:
        raise UserError(f"--transformer-impl transformer_engine builds Transformer Engine's "
                        f"layers; --precision-recipe {precision.precision_recipe} runs "
                        "megatron-core's local ones: drop one (te-fp8 is FP8 on TE's layers)")
    check_attention_precision(config)
    check_static_recovery(config)
    if precision.precision_config_file and not backend(precision).quantizes:
        raise UserError("--precision-config-file needs a --precision-recipe: without one "
                        "every unit already runs in the run's precision")
    if precision.moe_dispatch_quant and not config.model.num_experts:
        raise UserError("--moe-dispatch-quant needs an MoE model (--num-experts N)")
    if backend(precision).validate is not None:
        backend(precision).validate(config)


def check_attention_precision(config) -> None:
    from megatron_gnmr.precision.attention_fault import fault_layers
    from megatron_gnmr.precision.attention_unit import switchable_attention
    from megatron_gnmr.precision.backends import backend

    precision = config.precision
    if precision.attention_fp8_output and precision.attention_precision != "fp8":
        raise UserError("--attention-fp8-output holds O in FP8 inside FP8 attention's backward; "
                        "give --attention-precision fp8")
    training = config.training
    if not training.attention_fault_bits:
        for flag, value, default in (("rounding", training.attention_fault_rounding, "down"),
                                     ("share", training.attention_fault_share, 1.0),
                                     ("peak", training.attention_fault_peak, 0.0)):
            if value != default:
                raise UserError(f"--attention-fault-{flag} shapes the attention fault; give "
                                "--attention-fault-bits N to turn the fault on")
    try:
        fault_layers(config.training.attention_fault_layers, config.model.num_layers,
                     config.training.seed)
    except ValueError as error:
        raise UserError(f"--attention-fault-layers {error}") from None
    if not switchable_attention(config):
        return
    if backend(precision).transformer_engine_layers:
        raise UserError(f"--attention-precision / --attention-fault-bits with --precision-recipe "
                        f"{precision.precision_recipe}: the switchable core attention is the "
                        "emulated one of the local layer spec; this backend builds its own "
                        "layers, and its FP8 attention (Transformer Engine's fp8_dpa) is set for "
                        "the whole model, not per layer")
    if config.gnmr.enabled and config.parallel.expert_model_parallel_size > 1:
        raise UserError("--attention-precision / --attention-fault-bits with --gnmr and "
                        "--expert-model-parallel-size > 1 is not supported yet (the core "
                        "attention's gradient sums need the world all-reduce, which counts "
                        "parameter norms on data-parallel rank 0 only)")


def check_static_recovery(config) -> None:
    """--precision-recovery-gemms and --first-last-layers-bf16 (and its two counts)."""
    from megatron_gnmr.precision.backends import backend
    from megatron_gnmr.precision.paths import GEMM_ROLES

    precision = config.precision
    roles = precision.precision_recovery_gemms.split(",")
    if not roles or any(role not in GEMM_ROLES for role in roles) or \
            len(set(roles)) != len(roles):
        raise UserError(f"--precision-recovery-gemms {precision.precision_recovery_gemms!r}: "
                        f"give a comma list of distinct GEMMs from {', '.join(GEMM_ROLES)}")
    if set(roles) != set(GEMM_ROLES) and not backend(precision).per_gemm_recovery:
        raise UserError(f"--precision-recovery-gemms {precision.precision_recovery_gemms}: "
                        f"--precision-recipe {precision.precision_recipe} switches a unit's "
                        "GEMMs together; per-GEMM recovery needs an emulated recipe")
    for flag in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
        value = getattr(precision, flag)
        if not 0 <= value <= config.model.num_layers:
            raise UserError(f"--{flag.replace('_', '-')} {value}: use 0 to --num-layers "
                            f"({config.model.num_layers})")
    if precision.first_last_layers_bf16 and not backend(precision).quantizes:
        raise UserError("--first-last-layers-bf16 needs a --precision-recipe: without one "
                        "every layer already runs in the run's precision")
