"""What happens around a training step that is not training: Megatron-LM's garbage collection
(--manual-gc), freeing the accelerator's cached memory (--empty-unused-memory-level), the
profiler (--profile) and the throughput figure (--log-throughput). Its own config section,
`housekeeping` (the flags are Megatron-LM's names)."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megatron_gnmr.limits import check_limits, limit


@dataclass
class HousekeepingConfig:
    manual_gc: bool = False
    """Python's garbage collector only every --manual-gc-interval steps (and not between)."""
    manual_gc_interval: int = limit(0, ge=0)
    """--manual-gc: collect every N steps (0: only at evaluation and at the end)."""
    empty_unused_memory_level: int = limit(0, choices=(0, 1, 2))
    """Free the accelerator's cached memory: 1 after each step, 2 also after evaluation."""
    profile: bool = False
    """Profile steps --profile-step-start to --profile-step-end (torch.profiler; the trace is
    written to <--save>/profile/)."""
    use_pytorch_profiler: bool = False
    """Megatron-LM's choice of torch.profiler for --profile (the only profiler here)."""
    profile_step_start: int = limit(10, ge=1)
    """--profile: the first profiled step."""
    profile_step_end: int = limit(12, ge=1)
    """--profile: the step after the last profiled one."""
    log_throughput: bool = False
    """Log train/tflops_per_device: the model's FLOPs per step (Megatron-LM's formula) over
    the step time and the processes."""

    def __post_init__(self) -> None:
        check_limits(self, "housekeeping")
        if self.profile and self.profile_step_end <= self.profile_step_start:
            raise ValueError("housekeeping.profile_step_end must be after profile_step_start")


class Housekeeping:
    def __init__(self, config: HousekeepingConfig, run_dir: Optional[str]):
        self.config = config
        self.run_dir = run_dir
        self.profiler = None
        if config.manual_gc:
            gc.disable()

    def before_step(self, step: int) -> None:
        """`step`: the 1-based step about to run."""
        c = self.config
        if c.profile and step == c.profile_step_start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=False)
            self.profiler.__enter__()

    def after_step(self, step: int) -> None:
        c = self.config
        if self.profiler is not None and step + 1 == c.profile_step_end:
            self.profiler.__exit__(None, None, None)
            if self.run_dir:
                out = Path(self.run_dir) / "profile"
                out.mkdir(parents=True, exist_ok=True)
                rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
                self.profiler.export_chrome_trace(str(out / f"rank{rank}_steps"
                                                      f"{c.profile_step_start}-{step}.json"))
            self.profiler = None
        if c.manual_gc and c.manual_gc_interval and step % c.manual_gc_interval == 0:
            gc.collect()
        if c.empty_unused_memory_level >= 1 and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def after_evaluation(self) -> None:
        if self.config.manual_gc:
            gc.collect()
        if self.config.empty_unused_memory_level >= 2 and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def close(self) -> None:
        if self.config.manual_gc:
            gc.enable()
