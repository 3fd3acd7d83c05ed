"""Side-by-side training for benchmarks: several trainers in one process, stepped in
rotating order so that machine drift hits every variant alike. Not used in training."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field


@dataclass
class SideBySideRun:
    trainer: object
    seconds: list[float] = field(default_factory=list)  # per measured step (after warm-up)
    losses: list[float] = field(default_factory=list)  # every step's training loss


def train_side_by_side(variants: dict[str, list[str]], steps: int,
                       warmup: int = 3) -> dict[str, SideBySideRun]:
    """Train each variant (a list of pretrain flags) for `warmup + steps` steps, monitors
    included, all from the same seed; returns their step times and losses."""
    import torch

    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.platform.device import has_accelerator
    from megatron_gnmr.training import distributed
    from megatron_gnmr.training.loop import Trainer

    configs = {name: parse_config(flags) for name, flags in variants.items()}
    distributed.initialize(next(iter(configs.values())))
    runs = {}
    for name, config in configs.items():
        distributed.set_seeds(config.training.seed)
        runs[name] = SideBySideRun(Trainer(config))
    names = list(runs)
    for step in range(warmup + steps):
        rotation = names[step % len(names):] + names[: step % len(names)]
        for name in rotation:
            run = runs[name]
            if has_accelerator():
                torch.cuda.synchronize()
            start = time.perf_counter()
            metrics = run.trainer.train_step(step)  # the monitors' check and decision included
            if has_accelerator():  # the optimizer's work ends on the device, not at return
                torch.cuda.synchronize()
            if step >= warmup:
                run.seconds.append(time.perf_counter() - start)
            run.losses.append(metrics["train/loss"])
    return runs


def time_training_steps(variants: dict[str, list[str]], steps: int, warmup: int = 3,
                        mean: bool = False) -> dict[str, float]:
    """Median (or, for work done every N steps, mean) seconds per optimizer step for each
    variant (a list of pretrain flags), monitors included."""
    summary = statistics.mean if mean else statistics.median
    return {name: summary(run.seconds)
            for name, run in train_side_by_side(variants, steps, warmup).items()}
