"""Checks across config sections and against the launch: every failure is a UserError that
names the flag (or YAML key) at fault and how to fix it, raised before anything is built or
written. Single-field rules (ranges, finiteness) live in the config dataclasses themselves
(`config.limit`); the paths the user gives are checked in `input_files.py`.
"""

from __future__ import annotations

import re

from megatron_gnmr import input_files
from megatron_gnmr.checkpoints.formats import checkpoint_format
from megatron_gnmr.config import RunConfig, flag_name
from megatron_gnmr.errors import UserError
from megatron_gnmr.monitors.detectors import DETECTORS
from megatron_gnmr.monitors.families import FAMILIES, parse_families
from megatron_gnmr.platform import attention_environment
from megatron_gnmr.precision.checks import check_precision
from megatron_gnmr.training.run_directory import check_run_directory


def validate(config: RunConfig, world_size: int) -> None:
    """Everything a launch can be refused for before it starts. Raises UserError."""
    validate_model(config)
    validate_layout(config, world_size)
    validate_lora(config)
    validate_scale_features(config)
    validate_schedule(config)
    check_precision(config)
    validate_precision_config_file(config)
    validate_logging(config)
    validate_monitors(config)
    validate_moe(config, world_size)
    validate_controller(config)
    validate_run(config)
    input_files.check_data(config.data)


def validate_model(config: RunConfig) -> None:
    """The model family can build this model, and no other family's setting is set."""
    from megatron_gnmr.model_families import family_of, inapplicable_settings

    foreign = inapplicable_settings(config)
    if foreign:
        section, name, family = foreign[0]
        raise UserError(f"{flag_name(section, name)} is a setting of --model-family {family}; "
                        f"this run's is {config.model.model_family}")
    family_of(config).check(config)


def validate_layout(config: RunConfig, world_size: int) -> None:
    m, p, t = config.model, config.parallel, config.training
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if not m.untie_embeddings_and_output_weights and pp > 1:
        raise UserError(f"--no-untie-embeddings-and-output-weights at "
                        f"--pipeline-model-parallel-size {pp}: tied embeddings are built at one "
                        "pipeline stage only (the last stage's copy of the embedding is not "
                        "synchronised or counted once in the gradient norm here); untie them "
                        "or use PP 1")
    if m.padded_vocab_size is not None and m.padded_vocab_size % tp:
        raise UserError(f"--padded-vocab-size {m.padded_vocab_size} must be divisible by "
                        f"--tensor-model-parallel-size {tp} (the embedding is split by rows)")
    if m.ffn_hidden_size % tp:
        raise UserError(f"--tensor-model-parallel-size {tp} must divide --ffn-hidden-size")
    if m.num_layers % pp:
        raise UserError(
            f"--pipeline-model-parallel-size {pp} must divide --num-layers {m.num_layers}")
    if world_size % (tp * pp):
        raise UserError(
            f"the launch has {world_size} processes, not a multiple of TP x PP = {tp * pp}; "
            "change --nproc_per_node or the parallel sizes")
    if p.distributed_backend == "gloo":
        from megatron_gnmr.platform.device import has_accelerator

        if has_accelerator():
            raise UserError("--distributed-backend gloo: megatron-gnmr's collectives on GPUs are "
                            "NCCL's; give nccl (or leave the flag out)")
    dp = world_size // (tp * pp)
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise UserError(
            f"--global-batch-size {t.global_batch_size} must be a multiple of "
            f"--micro-batch-size {t.micro_batch_size} x data-parallel size {dp}")


def validate_scale_features(config: RunConfig) -> None:
    """megatron's memory and overlap features: megatron's own rules, as one-line errors."""
    p, t = config.parallel, config.training
    if p.overlap_param_gather and not (p.use_distributed_optimizer and p.overlap_grad_reduce):
        raise UserError("--overlap-param-gather needs --use-distributed-optimizer and "
                        "--overlap-grad-reduce (megatron gathers the optimizer's weight shards)")
    _validate_recompute(t, config.model.num_layers // p.pipeline_model_parallel_size)
    if t.gradient_accumulation_fusion:
        from megatron_gnmr.platform import capabilities
        from megatron_gnmr.precision.backends import backend

        te_layers = backend(config.precision).transformer_engine_layers
        fusion = capabilities.gradient_accumulation_fusion(te_layers)
        if not fusion:
            raise UserError(f"--gradient-accumulation-fusion: {fusion.reason}")
    _validate_attention_backend(config)


def _validate_recompute(t, layers_per_stage: int) -> None:
    if t.recompute_granularity == "full":
        if t.recompute_method is None or t.recompute_num_layers is None:
            raise UserError("--recompute-granularity full needs --recompute-method (uniform or "
                            "block) and --recompute-num-layers")
        if t.recompute_num_layers > layers_per_stage:
            raise UserError(f"--recompute-num-layers {t.recompute_num_layers} exceeds the "
                            f"{layers_per_stage} layers of a pipeline stage")
    elif t.recompute_method is not None or t.recompute_num_layers is not None:
        raise UserError("--recompute-method and --recompute-num-layers go with "
                        "--recompute-granularity full (selective recomputes core attention)")


def _validate_attention_backend(config: RunConfig) -> None:
    from megatron_gnmr.precision.backends import backend

    t = config.training
    if t.use_flash_attn and t.attention_backend not in ("auto", "flash"):
        raise UserError(f"--use-flash-attn asks for flash attention, --attention-backend "
                        f"{t.attention_backend} for another; give one of them")
    chosen = "flash" if t.use_flash_attn else t.attention_backend
    wrong = attention_environment.disagreements(chosen)
    if wrong:
        found = ", ".join(f"{name}={value}" for name, (value, _) in wrong.items())
        wants = ", ".join(f"{name}={value}" for name, (_, value) in wrong.items())
        raise UserError(f"{found} in the environment disagrees with --attention-backend "
                        f"{chosen}: megatron-core sets {wants} for it and refuses another "
                        f"value. Unset {', '.join(attention_environment.VARIABLES)} and choose "
                        "the attention with --attention-backend")
    uses_te = backend(config.precision).transformer_engine_layers
    if chosen == "local" and uses_te:
        raise UserError("--attention-backend local is megatron's own attention, which the "
                        "Transformer Engine layers of --precision-recipe te-fp8 do not use")
    if t.compile and uses_te:
        raise UserError("--compile compiles megatron-core's local layers; Transformer Engine's "
                        "layers (--precision-recipe te-fp8 / te) bring their own fused kernels: "
                        "drop --compile, or use a local-layer recipe (fp8-torchao, fp8-emulated)")


def validate_schedule(config: RunConfig) -> None:
    from megatron_gnmr.training.lr_schedule import check_schedule

    check_schedule(config.training)


def validate_precision_config_file(config: RunConfig) -> None:
    """The whole file as megatron reads it, against the model's unit names (raises a
    UserError naming the problem)."""
    if config.precision.precision_config_file:
        from megatron_gnmr.controller.units import UnitShape
        from megatron_gnmr.precision.kept_high import kept_high

        kept_high(config.precision, UnitShape.of_run(config).names())


def validate_logging(config: RunConfig) -> None:
    logging = config.logging
    if logging.wandb_project and not config.checkpoint.save:
        raise UserError("--wandb-project needs --save DIR (W&B files are kept in the run "
                        "directory)")
    if logging.tensorboard_dir is not None:
        input_files.writable_directory("--tensorboard-dir", logging.tensorboard_dir)


def validate_monitors(config: RunConfig) -> None:
    monitor = config.monitor
    try:
        families = parse_families(monitor.monitors)
    except ValueError as error:
        raise UserError(f"--monitors: {error}") from None
    for name in families:
        if FAMILIES[name].needs_experts and not config.model.num_experts:
            raise UserError(f"--monitors {name} needs an MoE model (--num-experts N)")
    if monitor.monitor_delta > monitor.monitor_interval:
        raise UserError(f"--monitor-delta {monitor.monitor_delta} must be in [1, "
                        f"--monitor-interval {monitor.monitor_interval}]")
    if monitor.monitor_detector not in DETECTORS:
        raise UserError(f"--monitor-detector {monitor.monitor_detector!r}: use one of "
                        f"{', '.join(DETECTORS)}")
    try:
        DETECTORS[monitor.monitor_detector].check(monitor)
    except ValueError as error:
        raise UserError(str(error)) from None
    input_files.check_references(monitor.monitor_reference)


def validate_moe(config: RunConfig, world_size: int) -> None:
    m, p = config.model, config.parallel
    ep = p.expert_model_parallel_size
    if not m.num_experts:
        if ep != 1:
            raise UserError("--expert-model-parallel-size needs an MoE model (--num-experts N)")
        return
    if m.moe_router_topk > m.num_experts:
        raise UserError(f"--moe-router-topk {m.moe_router_topk} must not exceed --num-experts "
                        f"{m.num_experts}")
    if m.num_experts % ep:
        raise UserError(f"--expert-model-parallel-size {ep} must divide --num-experts "
                        f"{m.num_experts}")
    _validate_router(m)
    if m.moe_first_dense_layers >= m.num_layers:
        raise UserError(f"--moe-first-dense-layers {m.moe_first_dense_layers} must be below "
                        f"--num-layers {m.num_layers} (at least one MoE layer)")
    if (world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)) % ep:
        raise UserError(f"--expert-model-parallel-size {ep} must divide the data-parallel size")
    from megatron_gnmr.precision.backends import BACKENDS, backend

    if not backend(config.precision).experts:
        able = ", ".join(name for name, b in BACKENDS.items() if b.experts)
        raise UserError(f"--precision-recipe {config.precision.precision_recipe} with "
                        f"--num-experts is not supported yet ({able} are)")


def _validate_router(m) -> None:
    groups, chosen = m.moe_router_num_groups, m.moe_router_group_topk
    if (groups is None) != (chosen is None):
        raise UserError("--moe-router-num-groups and --moe-router-group-topk go together "
                        "(group-limited routing: the groups, and how many a token may use)")
    if groups is not None:
        if m.num_experts % groups:
            raise UserError(f"--moe-router-num-groups {groups} must divide --num-experts "
                            f"{m.num_experts}")
        if chosen > groups:
            raise UserError(f"--moe-router-group-topk {chosen} must not exceed "
                            f"--moe-router-num-groups {groups}")
        if m.moe_router_topk > chosen * (m.num_experts // groups):
            raise UserError(f"--moe-router-topk {m.moe_router_topk} exceeds the experts of "
                            f"--moe-router-group-topk {chosen} groups of "
                            f"{m.num_experts // groups}")
    if m.moe_router_topk == 1 and m.moe_router_score_function == "softmax" and \
            not m.moe_router_pre_softmax:
        raise UserError("--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax "
                        "(a softmax over one chosen expert is 1: its gradient is zero)")
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        raise UserError("--moe-router-enable-expert-bias needs --moe-router-score-function "
                        "sigmoid (megatron's auxiliary-loss-free balancing is defined on "
                        "sigmoid scores)")


def validate_controller(config: RunConfig) -> None:
    t, gnmr = config.training, config.gnmr
    if t.inject_nonfinite:
        from megatron_gnmr.controller.units import UnitShape
        from megatron_gnmr.training.faults import parse_injections

        known = set(UnitShape.of(config).names())
        for units in parse_injections(t.inject_nonfinite).values():
            for unit in units:
                if unit not in known:
                    raise UserError(f"--inject-nonfinite: no unit {unit!r} (names look like "
                                    "'layers.0.mlp.linear_fc2')")
    try:
        re.compile(gnmr.units)
    except re.error as error:
        raise UserError(f"--gnmr-units {gnmr.units!r}: not a valid regex ({error})") from None
    if not gnmr.enabled:
        return
    from megatron_gnmr.controller.units import UnitShape, eligible_unit_names

    from megatron_gnmr.lora.adapters import lora_units

    eligible_unit_names(UnitShape.of_run(config), gnmr.units, lora_units(config))  # raises if none
    probed = gnmr.probed()
    from megatron_gnmr.precision.attention_unit import switchable_attention
    from megatron_gnmr.precision.backends import BACKENDS, backend
    from megatron_gnmr.precision.measurements import watching

    of_linears, of_attention = watching(probed, "linear"), watching(probed, "attention")
    if of_linears and not backend(config.precision).probes:
        able = ", ".join(name for name, b in BACKENDS.items() if b.probes)
        raise UserError(f"--gnmr-signals/--gnmr-measure {','.join(of_linears)} measure the "
                        f"low-cost path where it quantizes; use --precision-recipe {able} (not "
                        f"{config.precision.precision_recipe})")
    if of_attention and not switchable_attention(config):
        raise UserError(f"--gnmr-signals/--gnmr-measure {','.join(of_attention)} measure the "
                        "core attention's low-cost path; give it one with --attention-precision "
                        "fp8 or --attention-fault-bits N")
    if probed and config.parallel.expert_model_parallel_size > 1:
        raise UserError(f"--gnmr-signals/--gnmr-measure {','.join(probed)} are not supported "
                        "with --expert-model-parallel-size > 1 yet")
    from megatron_gnmr.controller.signals import parse_signals

    if "monitor" in parse_signals(gnmr.signals) and not config.monitor.monitors:
        raise UserError("--gnmr-signals monitor needs --monitors attention and/or router")


def validate_lora(config: RunConfig) -> None:
    lora, p = config.lora, config.parallel
    if config.checkpoint.finetune and config.checkpoint.load is None:
        raise UserError("--finetune reads the model weights of --load BASE_RUN: give --load")
    if not lora.enabled:
        return
    from megatron_gnmr.controller.units import UnitShape
    from megatron_gnmr.lora.adapters import check_dim, check_rank, check_targets, lora_targets
    from megatron_gnmr.precision.backends import backend as precision_backend

    if precision_backend(config.precision).transformer_engine_layers:
        raise UserError(f"--lora with --precision-recipe {config.precision.precision_recipe} "
                        "is not supported yet: TE fuses "
                        "the norm into the attention's input projection and linear_fc1, whose "
                        "adapters need the "
                        "normalised input")
    if p.sequence_parallel:
        raise UserError("--lora with --sequence-parallel is not supported yet")
    check_dim(lora, p.tensor_model_parallel_size)
    check_rank(lora, config)
    check_targets(lora_targets(config), UnitShape.of(config).names())


def validate_run(config: RunConfig) -> None:
    """--save, --load, --resume, --overwrite."""
    t = config.checkpoint
    # --save comes at launch: the configs are templates that set an interval and --resume
    # auto without a directory (estimate-memory reads them as they are), so a run starting
    # is where it must be there
    if t.save is None and t.save_interval:
        raise UserError("--save-interval needs --save DIR")
    if t.resume == "auto" and t.save is None:
        raise UserError("--resume auto needs --save DIR (it resumes from that directory)")
    if t.overwrite and (t.save is None or t.resume == "auto"):
        raise UserError("--overwrite starts a new run in --save DIR (deleting its checkpoints);"
                        " it needs --save and contradicts --resume auto")
    # the format's default is LoRA's choice (RunConfig): checked here, across the sections
    if (t.async_save or t.ckpt_fully_parallel_load or t.dist_ckpt_optim_fully_reshardable) and \
            not checkpoint_format(t.ckpt_format).sharded_save:
        flag = next(f for f, on in (("--async-save", t.async_save),
                                    ("--ckpt-fully-parallel-load", t.ckpt_fully_parallel_load),
                                    ("--dist-ckpt-optim-fully-reshardable",
                                     t.dist_ckpt_optim_fully_reshardable)) if on)
        raise UserError(f"{flag} is for --ckpt-format torch_dist (this run writes "
                        f"{t.ckpt_format})")
    if t.save is not None:
        input_files.writable_directory("--save", t.save)
    input_files.check_load(t.load)
    check_run_directory(t)
