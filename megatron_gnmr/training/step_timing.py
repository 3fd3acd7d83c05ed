"""Side-by-side step timing for benchmarks: several trainers in one process, stepped in
rotating order so that machine drift hits every variant alike. Not used in training."""

from __future__ import annotations

import statistics
import time


def time_training_steps(variants: dict[str, list[str]], steps: int, warmup: int = 3,
                        mean: bool = False) -> dict[str, float]:
    """Median (or, for work done every N steps, mean) seconds per optimizer step for each
    variant (a list of pretrain flags), monitors included."""
    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.training import distributed
    from megatron_gnmr.training.loop import Trainer

    configs = {name: parse_config(flags) for name, flags in variants.items()}
    distributed.initialize(next(iter(configs.values())))
    trainers = {}
    for name, config in configs.items():
        distributed.set_seeds(config.training.seed)
        trainers[name] = Trainer(config)
    names = list(trainers)
    times: dict[str, list[float]] = {name: [] for name in names}
    for step in range(warmup + steps):
        rotation = names[step % len(names):] + names[: step % len(names)]
        for name in rotation:
            trainer = trainers[name]
            start = time.perf_counter()
            if trainer.monitors is not None:
                trainer.monitors.before_step(step + 1)
            trainer.train_step(step)
            if trainer.monitors is not None:
                trainer.monitors.after_step(step + 1)
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
    summary = statistics.mean if mean else statistics.median
    return {name: summary(values) for name, values in times.items()}
