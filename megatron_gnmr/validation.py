"""Cross-field checks of a RunConfig against the launch: every failure is a UserError that
names the flag (or YAML key) at fault and how to fix it, raised before anything is built or
written. Single-field rules live in the config dataclasses themselves."""

from __future__ import annotations

from pathlib import Path

from megatron_gnmr.config import RunConfig
from megatron_gnmr.errors import UserError
from megatron_gnmr.monitors.detectors import DETECTORS


def validate(config: RunConfig, world_size: int) -> None:
    """Cross-field checks that need the whole config and the launch size. Raises UserError."""
    m, p, t = config.model, config.parallel, config.training
    positive = {
        "--num-layers": m.num_layers,
        "--hidden-size": m.hidden_size,
        "--ffn-hidden-size": m.ffn_hidden_size,
        "--num-attention-heads": m.num_attention_heads,
        "--seq-length": m.seq_length,
        "--tensor-model-parallel-size": p.tensor_model_parallel_size,
        "--pipeline-model-parallel-size": p.pipeline_model_parallel_size,
        "--micro-batch-size": t.micro_batch_size,
        "--global-batch-size": t.global_batch_size,
        "--train-iters": t.train_iters,
        "--log-interval": t.log_interval,
        "--eval-interval": t.eval_interval,
        "--keep-last": t.keep_last,
        "--vocab-size": config.data.vocab_size,
    }
    for flag, value in positive.items():
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    for flag, value in {"--lr": t.lr, "--min-lr": t.min_lr, "--clip-grad": t.clip_grad}.items():
        if value < 0:
            raise UserError(f"{flag} must be >= 0, got {value}")
    if m.hidden_size % m.num_attention_heads:
        raise UserError(
            f"--hidden-size {m.hidden_size} must be divisible by --num-attention-heads "
            f"{m.num_attention_heads}"
        )
    groups = m.num_query_groups or m.num_attention_heads
    if m.num_attention_heads % groups:
        raise UserError(
            f"--num-attention-heads {m.num_attention_heads} must be divisible by "
            f"--num-query-groups {groups}"
        )
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if m.num_attention_heads % tp or groups % tp:
        raise UserError(
            f"--tensor-model-parallel-size {tp} must divide --num-attention-heads "
            f"{m.num_attention_heads} and --num-query-groups {groups}; pick a TP size that does"
        )
    if m.ffn_hidden_size % tp:
        raise UserError(f"--tensor-model-parallel-size {tp} must divide --ffn-hidden-size")
    if m.num_layers % pp:
        raise UserError(
            f"--pipeline-model-parallel-size {pp} must divide --num-layers {m.num_layers}"
        )
    if world_size % (tp * pp):
        raise UserError(
            f"the launch has {world_size} processes, not a multiple of TP x PP = {tp * pp}; "
            "change --nproc_per_node or the parallel sizes"
        )
    dp = world_size // (tp * pp)
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise UserError(
            f"--global-batch-size {t.global_batch_size} must be a multiple of "
            f"--micro-batch-size {t.micro_batch_size} x data-parallel size {dp}"
        )
    validate_precision(config)
    if not 0 <= t.attention_fault_bits <= 10 or t.attention_fault_start < 1:
        raise UserError("--attention-fault-bits must be in [0, 10] and --attention-fault-start "
                        ">= 1")
    validate_logging(config)
    validate_monitors(config)
    validate_moe(config, world_size)
    if t.inject_nonfinite:
        from megatron_gnmr.controller.units import canonical_unit_names
        from megatron_gnmr.training.faults import parse_injections

        known = set(canonical_unit_names(m.num_layers, m.num_experts))
        for units in parse_injections(t.inject_nonfinite).values():
            for unit in units:
                if unit not in known:
                    raise UserError(f"--inject-nonfinite: no unit {unit!r} (names look like "
                                    "'layers.0.mlp.linear_fc2')")
    if config.gnmr.enabled:
        from megatron_gnmr.controller.units import eligible_unit_names

        eligible_unit_names(m.num_layers, config.gnmr.units, m.num_experts)  # raises if empty
        validate_signals(config)
    if t.save is None and t.save_interval:
        raise UserError("--save-interval needs --save DIR")
    if t.resume not in (None, "auto"):
        raise UserError(f"--resume must be 'auto', got {t.resume!r}")
    if t.resume == "auto" and t.save is None:
        raise UserError("--resume auto needs --save DIR (it resumes from that directory)")
    if not 0 <= t.lr_warmup_iters < t.train_iters:
        raise UserError(f"--lr-warmup-iters {t.lr_warmup_iters} must be >= 0 and below "
                        f"--train-iters {t.train_iters}")
    if t.min_lr > t.lr:
        raise UserError(f"--min-lr {t.min_lr} must not exceed --lr {t.lr}")


def validate_signals(config: RunConfig) -> None:
    gnmr, recipe = config.gnmr, config.precision.precision_recipe
    probed = gnmr.probed()
    if probed and recipe in ("none", "te-fp8"):
        raise UserError(f"--gnmr-signals/--gnmr-measure {','.join(probed)} measure the "
                        "emulated low-cost path; use --precision-recipe act-quant, "
                        f"fp8-emulated or deepseek (not {recipe})")
    if probed and config.parallel.expert_model_parallel_size > 1:
        raise UserError(f"--gnmr-signals/--gnmr-measure {','.join(probed)} are not supported "
                        "with --expert-model-parallel-size > 1 yet")
    from megatron_gnmr.controller.signals import parse_signals

    if "monitor" in parse_signals(gnmr.signals) and not config.monitor.monitors:
        raise UserError("--gnmr-signals monitor needs --monitors attention and/or router")


def validate_precision(config: RunConfig) -> None:
    from megatron_gnmr.precision.recipes import build_recipe

    precision = config.precision
    if precision.precision_static not in ("low", "recovery"):
        raise UserError(f"--precision-static must be low or recovery, got "
                        f"{precision.precision_static!r}")
    if precision.act_quant_granularity not in ("tensor", "row", "tile"):
        raise UserError("--act-quant-granularity must be tensor, row or tile")
    build_recipe(precision)  # raises a UserError naming the flag
    if precision.precision_recipe == "te-fp8":
        from megatron_gnmr.precision.te_backend import validate_te_fp8

        validate_te_fp8(config)
    if precision.precision_recipe == "fp8-torchao":
        validate_torchao(config)


def validate_torchao(config: RunConfig) -> None:
    """fp8-torchao: torchao installed at a version read, and `torch._scaled_mm`'s shapes."""
    from megatron_gnmr.precision.gemm_shapes import shape_problems, unit_gemms
    from megatron_gnmr.precision.torchao_compat import require_torchao

    require_torchao()
    problems = shape_problems(unit_gemms(config), 16, 16, 16)
    if problems:
        raise UserError("--precision-recipe fp8-torchao: torch._scaled_mm needs every GEMM "
                        f"dimension to be a multiple of 16; {problems[0]}"
                        + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


def validate_logging(config: RunConfig) -> None:
    logging = config.logging
    if logging.wandb_mode not in (None, "offline", "online", "disabled"):
        raise UserError(f"--wandb-mode must be offline, online or disabled, got "
                        f"{logging.wandb_mode!r}")
    if logging.wandb_project and not config.training.save:
        raise UserError("--wandb-project needs --save DIR (W&B files are kept in the run "
                        "directory)")
    if logging.image_interval < 0:
        raise UserError(f"--image-interval must be >= 0, got {logging.image_interval}")


def validate_monitors(config: RunConfig) -> None:
    monitor = config.monitor
    families = set(filter(None, monitor.monitors.split(",")))
    unknown = families - {"attention", "router"}
    if unknown:
        raise UserError(f"--monitors: unknown monitor(s) {', '.join(sorted(unknown))}; use "
                        "attention, router")
    if "router" in families and not config.model.num_experts:
        raise UserError("--monitors router needs an MoE model (--num-experts N)")
    if monitor.monitor_interval < 1 or not 1 <= monitor.monitor_delta <= monitor.monitor_interval:
        raise UserError(f"--monitor-delta {monitor.monitor_delta} must be in [1, "
                        f"--monitor-interval {monitor.monitor_interval}]")
    if monitor.monitor_band <= 0 or monitor.monitor_patience < 1 or \
            monitor.monitor_baseline_samples < 2:
        raise UserError("--monitor-band must be > 0, --monitor-patience >= 1 and "
                        "--monitor-baseline-samples >= 2")
    if monitor.monitor_detector not in DETECTORS:
        raise UserError(f"--monitor-detector {monitor.monitor_detector!r}: use one of "
                        f"{', '.join(DETECTORS)}")
    if monitor.monitor_detector == "reference" and not monitor.monitor_reference:
        raise UserError("--monitor-detector reference needs --monitor-reference RUN_DIR ...")
    if monitor.monitor_detector == "online" and monitor.monitor_reference:
        raise UserError("--monitor-reference uses the reference detector; drop "
                        "--monitor-detector online or the references")
    if monitor.monitor_trend_window < 3 or monitor.monitor_trend_horizon < 0 or \
            monitor.monitor_reference_smooth < 1:
        raise UserError("--monitor-trend-window must be >= 3, --monitor-trend-horizon >= 0 "
                        "and --monitor-reference-smooth >= 1")
    for run_dir in monitor.monitor_reference:
        if not (Path(run_dir) / "metrics.jsonl").is_file():
            raise UserError(f"--monitor-reference {run_dir}: no metrics.jsonl there (a "
                            "reference is the --save directory of a finished healthy run)")


def validate_moe(config: RunConfig, world_size: int) -> None:
    m, p = config.model, config.parallel
    ep = p.expert_model_parallel_size
    if not m.num_experts:
        if ep != 1:
            raise UserError("--expert-model-parallel-size needs an MoE model (--num-experts N)")
        return
    if m.num_experts < 2 or not 1 <= m.moe_router_topk <= m.num_experts:
        raise UserError(f"--num-experts {m.num_experts} must be >= 2 and --moe-router-topk "
                        f"{m.moe_router_topk} in [1, num experts]")
    if m.num_experts % ep:
        raise UserError(f"--expert-model-parallel-size {ep} must divide --num-experts "
                        f"{m.num_experts}")
    if p.tensor_model_parallel_size != 1:
        raise UserError("MoE with --tensor-model-parallel-size > 1 needs sequence parallelism, "
                        "which megatron-core cannot run without apex/TE; use TP 1")
    if (world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)) % ep:
        raise UserError(f"--expert-model-parallel-size {ep} must divide the data-parallel size")
    if config.precision.precision_recipe not in ("none", "te-fp8"):
        raise UserError(f"--precision-recipe {config.precision.precision_recipe} with "
                        "--num-experts is not supported yet (te-fp8 is); the MoE model runs in "
                        "the run's precision")
