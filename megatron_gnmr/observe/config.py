"""The logging section of a run's config (W&B, TensorBoard, images, console)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_gnmr.limits import check_limits, limit


@dataclass
class LoggingConfig:
    wandb_project: Optional[str] = None
    """W&B project; W&B is off without it. Files stay in the run directory (--save)."""
    wandb_exp_name: Optional[str] = None
    """W&B run name (default: W&B's)."""
    wandb_entity: Optional[str] = None
    """W&B entity (team or user)."""
    wandb_group: Optional[str] = None
    """W&B run group (e.g. a scenario's variant); the `dashboard` workspace groups by it."""
    wandb_mode: Optional[str] = limit(None, choices=("offline", "online", "disabled"))
    """offline | online | disabled (default: online if an API key is configured, else offline)."""
    tensorboard_dir: Optional[str] = None
    """Write TensorBoard event files here (same scalar names as W&B)."""
    tensorboard_log_interval: int = limit(1, ge=1)
    """TensorBoard and W&B: a training step's scalars every N steps (Megatron-LM's meaning and
    default; the console and metrics.jsonl follow --log-interval)."""
    image_interval: int = limit(100, ge=0)
    """W&B/TensorBoard: log the recovery timeline image every N steps (0: never)."""
    log_params_norm: bool = False
    """Log the parameters' L2 norm at every step (`train/params_norm`; Megatron-LM's)."""
    log_num_zeros_in_grad: bool = False
    """Log how many gradient elements are exactly zero (`train/num_zeros_in_grad`)."""
    timing_log_level: int = limit(0, choices=(0, 1, 2))
    """Megatron-LM's timers: 0 is the step's time (`train/step_time_s`, on every console
    line); Megatron-LM's finer timers of levels 1 and 2 (forward-backward, optimizer, ...) are
    not taken here: the step time alone is logged, as the launch says at its start."""
    log_all_ranks: bool = False
    """Console lines from every rank (prefixed with the rank), not only rank 0."""

    def __post_init__(self) -> None:
        check_limits(self, "logging")
