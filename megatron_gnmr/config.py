"""Typed run configuration: one dataclass per section, the single source of defaults.

YAML files and command-line flags both map onto these dataclasses (`arguments.py`), so a
default or a validation rule is written exactly once. Field docstrings double as `--help`.
Each field's flag is Megatron's name for it (`--num-layers`, `--micro-batch-size`, ...);
the `gnmr` section's flags carry the `--gnmr-` prefix.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Optional

from megatron_gnmr.controller.config import GNMRConfig
from megatron_gnmr.errors import UserError


@dataclass
class ModelConfig:
    num_layers: int = 2
    """Decoder layers."""
    hidden_size: int = 128
    """Model width d_model."""
    ffn_hidden_size: int = 352
    """SwiGLU inner width (LLaMA uses ~8/3 * hidden, rounded)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: Optional[int] = None
    """Key/value heads for grouped-query attention (None: one per query head)."""
    seq_length: int = 128
    """Training sequence length in tokens."""
    rotary_base: int = 10000
    """RoPE base."""
    init_method_std: float = 0.02
    """Std of the normal weight initialisation."""
    norm_epsilon: float = 1e-5
    """RMSNorm epsilon."""
    num_experts: Optional[int] = None
    """MoE: experts per layer (megatron-core MoE layers, local experts); None: dense SwiGLU."""
    moe_router_topk: int = 2
    """MoE: experts per token."""
    moe_aux_loss_coeff: float = 1e-2
    """MoE: load-balancing loss weight."""


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """TP degree: splits heads and FFN columns across ranks."""
    pipeline_model_parallel_size: int = 1
    """PP degree: splits layers into stages (megatron's 1F1B schedule)."""
    expert_model_parallel_size: int = 1
    """EP degree for MoE: experts split across data-parallel ranks."""


@dataclass
class TrainingConfig:
    micro_batch_size: int = 4
    """Sequences per micro-batch per data-parallel rank."""
    global_batch_size: int = 8
    """Sequences per optimizer step over all data-parallel ranks (gradient accumulation)."""
    train_iters: int = 100
    """Optimizer steps."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of cosine decay."""
    lr_warmup_iters: int = 10
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    bf16: bool = False
    """Train in bf16 (fp32 master weights). Off on CPU by default: bf16 matmuls are slower."""
    seed: int = 1234
    """Seed for weights, data order and dropout."""
    log_interval: int = 10
    """Print and log metrics every N steps."""
    eval_interval: int = 50
    """Validation every N steps (and at the end)."""
    eval_iters: int = 4
    """Validation batches per evaluation."""
    save: Optional[str] = None
    """Run directory: checkpoints, metrics.jsonl and traces go here."""
    load: Optional[str] = None
    """Checkpoint directory to resume from (its `latest`)."""
    resume: Optional[str] = None
    """`auto`: resume from the newest complete checkpoint in --save if there is one."""
    save_interval: int = 0
    """Checkpoint every N steps (0: only at the end, if --save is set)."""
    keep_last: int = 2
    """Checkpoints kept in --save (older ones are deleted after a new one is complete)."""
    exit_interval: int = 0
    """Stop (after checkpointing) once the step count is a multiple of N (0: never)."""
    inject_nonfinite: Optional[str] = None
    """Test only: STEP:UNIT[,...] puts a NaN into that unit's gradient at that step."""


@dataclass
class DataConfig:
    data_path: Optional[str] = None
    """Megatron .bin/.idx prefix; default: the Shakespeare corpus prepared under --data-cache-dir."""
    tokenizer_model: Optional[str] = None
    """SentencePiece model for --data-path (default: the one prepared beside the data)."""
    data_cache_dir: str = ".cache/megatron_gnmr"
    """Where prepare-data caches corpora, the tokenizer and .bin/.idx files."""
    vocab_size: int = 4096
    """Tokenizer vocabulary for prepared data."""
    split: str = "95,5,0"
    """Train/valid/test split weights of the documents."""


@dataclass
class MonitorConfig:
    monitors: str = ""
    """Comma list of mechanism monitors to run: attention, router."""
    monitor_interval: int = 10
    """Measure every N steps."""
    monitor_delta: int = 10
    """Attention: dW spans this many steps (<= --monitor-interval)."""
    monitor_band: float = 4.0
    """Alarm when a signal leaves its baseline mean +- band x std ..."""
    monitor_patience: int = 3
    """... for this many consecutive checks."""
    monitor_baseline_samples: int = 16
    """Checks that form each signal's healthy baseline (after 2 start-up checks)."""
    monitor_d3: bool = False
    """Attention: also the second-order term D3 = dA dB^T."""


@dataclass
class LoggingConfig:
    wandb_project: Optional[str] = None
    """W&B project; W&B is off without it. Files stay in the run directory (--save)."""
    wandb_exp_name: Optional[str] = None
    """W&B run name (default: W&B's)."""
    wandb_entity: Optional[str] = None
    """W&B entity (team or user)."""
    wandb_mode: Optional[str] = None
    """offline | online | disabled (default: online if an API key is configured, else offline)."""
    tensorboard_dir: Optional[str] = None
    """Write TensorBoard event files here (same scalar names as W&B)."""
    image_interval: int = 100
    """W&B/TensorBoard: log the recovery timeline image every N steps (0: never)."""
    log_all_ranks: bool = False
    """Console lines from every rank (prefixed with the rank), not only rank 0."""


@dataclass
class PrecisionConfig:
    precision_recipe: str = "none"
    """none | fp8-emulated | deepseek | act-quant | te-fp8 (low-cost/recovery path pair)."""
    precision_static: str = "low"
    """Without --gnmr: every unit on the `low` cost path or on the `recovery` path."""
    fp8_format: str = "hybrid"
    """hybrid (E4M3 forward, E5M2 gradients) or e4m3 (everywhere)."""
    fp8_recipe: str = "tensorwise"
    """Scaling: tensorwise (current), blockwise (1x128 / 128x128), mxfp8; delayed is refused."""
    deepseek_low_format: str = "e2m3"
    """The 6-bit format of the deepseek recipe's low-cost path: e2m3 or e3m2."""
    act_quant_bits: int = 4
    """act-quant: bits of the saved activation on the low-cost path (2, 3, 4, 8)."""
    act_quant_recovery_bits: int = 8
    """act-quant: bits on the recovery path (8, or 16 for exact)."""
    act_quant_granularity: str = "tensor"
    """act-quant scale granularity: tensor, row, tile."""


@dataclass
class GNMRRunConfig(GNMRConfig):
    """The controller: the decision rule's knobs plus how it is wired into training."""

    enabled: bool = False
    """Turn the GNMR controller on (flag: --gnmr)."""
    units: str = (r"layers\.\d+\.(self_attention\.linear_(qkv|proj)"
                  r"|mlp\.(experts\.\d+\.)?linear_fc[12])$")
    """Regex over unit names selecting the eligible units (default: all decoder linears)."""
    nonfinite: str = "skip"
    """On a NaN/Inf gradient: `skip` the optimizer step, or `raise` (stop, keep checkpoint)."""
    trace_interval: int = 1
    """Write the per-unit trace (norms, scores, decision) every N steps (0: never)."""
    agreement_interval: int = 100
    """Every N steps all ranks check they hold the same controller state (0: never)."""
    max_nonfinite_steps: int = 10
    """Stop the run after this many consecutive steps with non-finite gradients."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.nonfinite not in ("skip", "raise"):
            raise ValueError(f"gnmr.nonfinite must be 'skip' or 'raise', got {self.nonfinite!r}")
        if self.max_nonfinite_steps < 1:
            raise ValueError(f"gnmr.max_nonfinite_steps must be >= 1, got "
                             f"{self.max_nonfinite_steps}")
        for name in ("trace_interval", "agreement_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"gnmr.{name} must be >= 0, got {getattr(self, name)}")

    def policy_config(self) -> GNMRConfig:
        names = [f.name for f in dataclasses.fields(GNMRConfig)]
        return GNMRConfig(**{name: getattr(self, name) for name in names})


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    gnmr: GNMRRunConfig = field(default_factory=GNMRRunConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def launch_world_size() -> int:
    """Processes in this launch (torchrun sets WORLD_SIZE; a plain `python` run is 1)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


SECTIONS = {name: kind for name, kind in typing.get_type_hints(RunConfig).items()}


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


def validate_precision(config: RunConfig) -> None:
    from megatron_gnmr.platform import capabilities
    from megatron_gnmr.precision.recipes import build_recipe

    precision = config.precision
    if precision.precision_static not in ("low", "recovery"):
        raise UserError(f"--precision-static must be low or recovery, got "
                        f"{precision.precision_static!r}")
    if precision.act_quant_granularity not in ("tensor", "row", "tile"):
        raise UserError("--act-quant-granularity must be tensor, row or tile")
    build_recipe(precision)  # raises a UserError naming the flag
    if precision.precision_recipe == "te-fp8":
        te = capabilities.transformer_engine()
        if not te:
            raise UserError(f"--precision-recipe te-fp8 needs Transformer Engine: {te.reason}; "
                            "use --precision-recipe fp8-emulated to emulate FP8 here")


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
    if config.precision.precision_recipe != "none":
        raise UserError("--precision-recipe with --num-experts is not supported yet; the MoE "
                        "model runs in the run's precision")
