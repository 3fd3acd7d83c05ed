"""Typed run configuration: one dataclass per section, the single source of defaults.

YAML files and command-line flags both map onto these dataclasses (`arguments.py`), so a
default or a validation rule is written exactly once. Field docstrings double as `--help`.
Each field's flag is Megatron's name for it (`--num-layers`, `--micro-batch-size`, ...);
the `gnmr` section's flags carry the `--gnmr-` prefix.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Optional

from megatron_gnmr.controller.config import GNMRConfig


def limit(default, *, ge=None, gt=None, le=None, lt=None):
    """A field's default and the range its value must lie in (checked by `check_limits`)."""
    return field(default=default, metadata={"limits": {">=": ge, ">": gt, "<=": le, "<": lt}})


_HOLDS = {">=": lambda v, b: v >= b, ">": lambda v, b: v > b, "<=": lambda v, b: v <= b,
          "<": lambda v, b: v < b}


def check_limits(instance, section: str) -> None:
    """Every number of a config section finite and inside its field's limits; a ValueError
    names `section.field` (the flag mapper turns that into the flag)."""
    for spec in dataclasses.fields(instance):
        value = getattr(instance, spec.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{section}.{spec.name} must be a finite number, got {value}")
        for relation, bound in spec.metadata.get("limits", {}).items():
            if bound is not None and not _HOLDS[relation](value, bound):
                raise ValueError(f"{section}.{spec.name} must be {relation} {bound}, got {value}")


@dataclass
class ModelConfig:
    num_layers: int = limit(2, ge=1)
    """Decoder layers."""
    hidden_size: int = limit(128, ge=1)
    """Model width d_model."""
    ffn_hidden_size: int = limit(352, ge=1)
    """SwiGLU inner width (LLaMA uses ~8/3 * hidden, rounded)."""
    num_attention_heads: int = limit(4, ge=1)
    """Query heads."""
    num_query_groups: Optional[int] = limit(None, ge=1)
    """Key/value heads for grouped-query attention (None: one per query head)."""
    seq_length: int = limit(128, ge=1)
    """Training sequence length in tokens."""
    rotary_base: int = limit(10000, gt=0)
    """RoPE base."""
    init_method_std: float = limit(0.02, gt=0)
    """Std of the normal weight initialisation."""
    norm_epsilon: float = limit(1e-5, gt=0)
    """RMSNorm epsilon."""
    num_experts: Optional[int] = limit(None, ge=2)
    """MoE: experts per layer (megatron-core MoE layers, local experts); None: dense SwiGLU."""
    moe_router_topk: int = limit(2, ge=1)
    """MoE: experts per token."""
    moe_aux_loss_coeff: float = limit(1e-2, ge=0)
    """MoE: load-balancing loss weight."""

    def __post_init__(self) -> None:
        check_limits(self, "model")


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = limit(1, ge=1)
    """TP degree: splits heads and FFN columns across ranks."""
    pipeline_model_parallel_size: int = limit(1, ge=1)
    """PP degree: splits layers into stages (megatron's 1F1B schedule)."""
    expert_model_parallel_size: int = limit(1, ge=1)
    """EP degree for MoE: experts split across data-parallel ranks."""

    def __post_init__(self) -> None:
        check_limits(self, "parallel")


@dataclass
class TrainingConfig:
    micro_batch_size: int = limit(4, ge=1)
    """Sequences per micro-batch per data-parallel rank."""
    global_batch_size: int = limit(8, ge=1)
    """Sequences per optimizer step over all data-parallel ranks (gradient accumulation)."""
    train_iters: int = limit(100, ge=1)
    """Optimizer steps."""
    lr: float = limit(3e-3, ge=0)
    """Peak learning rate."""
    min_lr: float = limit(3e-4, ge=0)
    """Learning rate at the end of cosine decay."""
    lr_warmup_iters: int = limit(10, ge=0)
    """Linear warm-up steps."""
    weight_decay: float = limit(0.1, ge=0)
    """AdamW decoupled weight decay."""
    adam_beta1: float = limit(0.9, ge=0, lt=1)
    """AdamW beta1."""
    adam_beta2: float = limit(0.95, ge=0, lt=1)
    """AdamW beta2."""
    clip_grad: float = limit(1.0, ge=0)
    """Clip the global gradient norm to this value (0 disables)."""
    bf16: bool = False
    """Train in bf16 (fp32 master weights). Off on CPU by default: bf16 matmuls are slower."""
    seed: int = limit(1234, ge=0, lt=2**32)
    """Seed for weights, data order and dropout."""
    use_cpu_initialization: bool = False
    """GPU: draw the full weights on the CPU and split them (every TP layout then starts from
    the same model; slow for large models). Always on when there is no GPU."""
    log_interval: int = limit(10, ge=1)
    """Print and log metrics every N steps."""
    eval_interval: int = limit(50, ge=1)
    """Validation every N steps (and at the end)."""
    eval_iters: int = limit(4, ge=1)
    """Validation batches per evaluation."""
    save: Optional[str] = None
    """Run directory: checkpoints, metrics.jsonl and traces go here."""
    load: Optional[str] = None
    """Checkpoint directory to resume from (its `latest`)."""
    resume: Optional[str] = None
    """`auto`: resume from the newest complete checkpoint in --save if there is one."""
    overwrite: bool = False
    """Start a new run in a --save directory that holds another run's checkpoints, deleting
    them (without it, such a launch is refused)."""
    save_interval: int = limit(0, ge=0)
    """Checkpoint every N steps (0: only at the end, if --save is set)."""
    keep_last: int = limit(2, ge=1)
    """Checkpoints kept in --save (older ones are deleted after a new one is complete)."""
    distributed_timeout_minutes: int = limit(10, ge=1)
    """A collective that waits longer than this (a rank died or hangs) fails the run."""
    exit_interval: int = limit(0, ge=0)
    """Stop (after checkpointing) once the step count is a multiple of N (0: never)."""
    inject_nonfinite: Optional[str] = None
    """Test only: STEP:UNIT[,...] puts a NaN into that unit's gradient at that step."""
    emulated_attention: bool = False
    """Core attention through an explicit flash-attention-style backward (fault studies)."""
    attention_fault_bits: int = limit(0, ge=0, le=10)
    """Fault study: round O to N mantissa bits toward -inf in delta = rowsum(dO * O) (0: off)."""
    attention_fault_start: int = limit(1, ge=1)
    """Fault study: the step the attention fault switches on."""

    def __post_init__(self) -> None:
        check_limits(self, "training")


@dataclass
class DataConfig:
    data_path: Optional[str] = None
    """Megatron .bin/.idx prefix; default: the Shakespeare corpus prepared under --data-cache-dir."""
    tokenizer_model: Optional[str] = None
    """SentencePiece model for --data-path (default: the one prepared beside the data)."""
    data_cache_dir: str = ".cache/megatron_gnmr"
    """Where prepare-data caches corpora, the tokenizer and .bin/.idx files."""
    vocab_size: int = limit(4096, gt=256, le=65536)
    """Tokenizer vocabulary for prepared data."""
    split: str = "95,5,0"
    """Train/valid/test split weights of the documents."""

    def __post_init__(self) -> None:
        check_limits(self, "data")


@dataclass
class MonitorConfig:
    monitors: str = ""
    """Comma list of mechanism monitors to run: attention, router."""
    monitor_interval: int = limit(10, ge=1)
    """Measure every N steps."""
    monitor_delta: int = limit(10, ge=1)
    """Attention: dW spans this many steps (<= --monitor-interval)."""
    monitor_detector: str = "trend"
    """Alarm detector: trend (the signal's own recent trend), reference (healthy reference
    runs' band; implied by --monitor-reference) or online (band of its first checks)."""
    monitor_reference: list[str] = field(default_factory=list, metadata={"metavar": "RUN_DIR"})
    """Run directories of healthy runs (same model, data, schedule) for the reference band."""
    monitor_band: float = limit(4.0, gt=0)
    """Alarm when a signal is more than band x its noise from the expected value ..."""
    monitor_patience: int = limit(5, ge=1)
    """... for this many consecutive checks."""
    monitor_baseline_samples: int = limit(16, ge=2)
    """online detector: checks that form each signal's baseline (after 2 start-up checks)."""
    monitor_trend_window: int = limit(16, ge=3)
    """trend detector: checks in the robust line fit."""
    monitor_trend_horizon: int = limit(12, ge=0)
    """trend detector: checks between the end of the fit window and the checked sample."""
    monitor_reference_smooth: int = limit(4, ge=1)
    """reference detector: live and reference signals are trailing means over this many checks."""
    monitor_d3: bool = False
    """Attention: also the second-order term D3 = dA dB^T."""

    def __post_init__(self) -> None:
        check_limits(self, "monitor")


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
    image_interval: int = limit(100, ge=0)
    """W&B/TensorBoard: log the recovery timeline image every N steps (0: never)."""
    log_all_ranks: bool = False
    """Console lines from every rank (prefixed with the rank), not only rank 0."""

    def __post_init__(self) -> None:
        check_limits(self, "logging")


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
    trace_interval: int = limit(1, ge=0)
    """Write the per-unit trace (norms, scores, decision) every N steps (0: never)."""
    agreement_interval: int = limit(100, ge=0)
    """Every N steps all ranks check they hold the same controller state (0: never)."""
    max_nonfinite_steps: int = limit(10, ge=1)
    """Stop the run after this many consecutive steps with non-finite gradients."""
    signals: str = "gnmr"
    """Risk signals, comma list (a unit's risk is the max of their scores): gnmr, qerr, monitor;
    baselines random, static, oracle (see controller/signals.py)."""
    measure: str = ""
    """Probed signals to measure and trace without acting on them (qerr, oracle), for replay."""
    qerr_ratio: float = limit(1.5, gt=0)
    """qerr: a unit is risky when its quantization error exceeds this x its baseline."""
    qerr_baseline: str = "history"
    """qerr baseline: history (the unit's own running mean, like GNMR) or peers (this step's
    median over units)."""
    static_units: str = r"mlp\.(experts\.\d+\.)?linear_fc2$"
    """static baseline: regex of the units it recovers."""
    selection_seed: int = limit(0, ge=0, lt=2**63)
    """random baseline: seed of its draws."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_limits(self, "gnmr")
        if self.nonfinite not in ("skip", "raise"):
            raise ValueError(f"gnmr.nonfinite must be 'skip' or 'raise', got {self.nonfinite!r}")
        from megatron_gnmr.controller.signals import PROBED, QERR_BASELINES, parse_signals

        parse_signals(self.signals)
        unknown = set(filter(None, self.measure.split(","))) - set(PROBED)
        if unknown:
            raise ValueError(f"gnmr.measure cannot measure {', '.join(sorted(unknown))}; "
                             f"use {', '.join(PROBED)}")
        if self.qerr_baseline not in QERR_BASELINES:
            raise ValueError(f"gnmr.qerr_baseline must be one of {QERR_BASELINES}, got "
                             f"{self.qerr_baseline!r}")

    def probed(self) -> tuple[str, ...]:
        """The probe measurements this run needs (to act on or to trace)."""
        from megatron_gnmr.controller.signals import PROBED, parse_signals

        wanted = set(parse_signals(self.signals)) | set(filter(None, self.measure.split(",")))
        return tuple(p for p in PROBED if p in wanted)

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


def flag_name(section: str, name: str) -> str:
    """The command-line flag of a config field (Megatron's name; `--gnmr-*` for the
    controller's section)."""
    if section == "gnmr":
        return "--gnmr" if name == "enabled" else f"--gnmr-{name.replace('_', '-')}"
    return f"--{name.replace('_', '-')}"
