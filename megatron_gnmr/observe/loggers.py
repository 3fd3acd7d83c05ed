"""Loggers behind one interface, so the training loop never asks which ones are on.

`MultiLogger` fans out to console, JSONL, W&B and TensorBoard (`build_loggers` picks them
from the config). Ranks other than the logging rank get a `NullLogger`, or a console with a
rank prefix under `--log-all-ranks`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Protocol

from megatron_gnmr.jsonl import keep_records_up_to


class Logger(Protocol):
    def log(self, step: int, metrics: dict) -> None: ...
    def image(self, step: int, key: str, figure) -> None: ...
    def event(self, step: int, kind: str, payload: dict) -> None: ...
    def close(self) -> None: ...


class NullLogger:
    def log(self, step: int, metrics: dict) -> None:
        pass

    def image(self, step: int, key: str, figure) -> None:
        pass

    def event(self, step: int, kind: str, payload: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _finite_or_none(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


class JsonlLogger:
    """One JSON object per line, flushed per record: readable while the run is going and
    after it crashed. Metrics records have `step`; events also have `event`."""

    def __init__(self, path: Path, resume_step: int = 0):
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():  # records past the resumed step (a crash's, or a cut line) go
            keep_records_up_to(path, resume_step if resume_step > 0 else -1)
        self.file = path.open("a", buffering=1)

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, "time": round(time.time(), 3)}
        record.update({k: _finite_or_none(v) for k, v in metrics.items()})
        self.file.write(json.dumps(record) + "\n")

    def image(self, step: int, key: str, figure) -> None:
        pass  # the report renders images from the JSONL itself

    def event(self, step: int, kind: str, payload: dict) -> None:
        self.log(step, {"event": kind, **payload})

    def close(self) -> None:
        self.file.close()


# --log-throughput, --log-num-zeros-in-grad and --log-params-norm, labelled and formatted as
# Megatron-LM's progress line prints them (`training_log`, core_v0.16.1)
MEGATRON_LM_STATS = (("train/tflops_per_device", "throughput per GPU (TFLOP/s/GPU)", ".1f"),
                     ("train/num_zeros_in_grad", "num zeros", ".0f"),
                     ("train/params_norm", "params norm", ".3f"))


class ConsoleLogger:
    """One line per logged step: step/total, loss, lr, grad norm, tokens/s, step time, ETA."""

    def __init__(self, total_steps: int, stream=None, prefix: str = ""):
        self.total_steps = total_steps
        self._stream = stream  # None: whatever sys.stdout is when a line is printed
        self.prefix = prefix

    @property
    def stream(self):
        return self._stream or sys.stdout

    def image(self, step: int, key: str, figure) -> None:
        pass

    def log(self, step: int, metrics: dict) -> None:
        if "train/loss" in metrics:
            eta = metrics.get("train/step_time_s", 0.0) * (self.total_steps - step)
            parts = [
                f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}",
                f"loss {metrics['train/loss']:.4f}",
                f"lr {metrics.get('train/lr', 0.0):.2e}",
                f"grad_norm {metrics.get('train/grad_norm', float('nan')):.3f}",
                f"tok/s {metrics.get('train/tokens_per_s', 0.0):,.0f}",
                f"step {metrics.get('train/step_time_s', 0.0) * 1000:.0f} ms",
                f"ETA {_duration(eta)}",
            ]
            if "gnmr/recovery_size" in metrics:
                parts.append(f"recovery {metrics['gnmr/recovery_size']}")
            parts += [f"{label}: {metrics[key]:{spec}}" for key, label, spec in MEGATRON_LM_STATS
                      if metrics.get(key) is not None]
            print(self.prefix + " | ".join(parts), file=self.stream, flush=True)
        if "valid/loss" in metrics:
            print(f"{self.prefix}validation at step {step}: loss {metrics['valid/loss']:.4f} "
                  f"ppl {metrics['valid/ppl']:.2f}", file=self.stream, flush=True)

    def event(self, step: int, kind: str, payload: dict) -> None:
        details = ", ".join(f"{k}={v}" for k, v in payload.items())
        print(f"{self.prefix}[{kind}] step {step}: {details}", file=self.stream, flush=True)

    def close(self) -> None:
        pass


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class EveryNSteps:
    """A logger that takes a training step's metrics (a record with `train/loss`) every
    `interval` steps and at the last step, and everything else (validation, monitors, events)
    as it comes: the console and metrics.jsonl follow --log-interval, TensorBoard and W&B
    --tensorboard-log-interval, as in Megatron-LM."""

    def __init__(self, logger, interval: int, last_step: int):
        self.logger, self.interval, self.last_step = logger, interval, last_step

    def log(self, step: int, metrics: dict) -> None:
        if "train/loss" not in metrics or step % self.interval == 0 or step == self.last_step:
            self.logger.log(step, metrics)

    def image(self, step: int, key: str, figure) -> None:
        self.logger.image(step, key, figure)

    def event(self, step: int, kind: str, payload: dict) -> None:
        self.logger.event(step, kind, payload)

    def close(self) -> None:
        self.logger.close()


class MultiLogger:
    def __init__(self, loggers: list):
        self.loggers = loggers

    def log(self, step: int, metrics: dict) -> None:
        for logger in self.loggers:
            logger.log(step, metrics)

    def image(self, step: int, key: str, figure) -> None:
        for logger in self.loggers:
            logger.image(step, key, figure)

    def event(self, step: int, kind: str, payload: dict) -> None:
        for logger in self.loggers:
            logger.event(step, kind, payload)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def build_loggers(config, run_dir: str | None, rank: int, resume_step: int = 0):
    """The loggers this rank should have. W&B and TensorBoard are imported only when on; if
    one fails to start, the ones already started are closed before the error goes on."""
    logging = config.logging
    total = config.training.train_iters

    def every_log_interval(logger):
        return EveryNSteps(logger, config.training.log_interval, total)

    def every_tensorboard_interval(logger):
        return EveryNSteps(logger, logging.tensorboard_log_interval, total)

    if rank != 0:
        return every_log_interval(ConsoleLogger(total, prefix=f"[rank {rank}] ")) \
            if logging.log_all_ranks else NullLogger()
    loggers: list = [every_log_interval(ConsoleLogger(total))]
    try:
        if run_dir:
            loggers.append(every_log_interval(JsonlLogger(Path(run_dir) / "metrics.jsonl",
                                                          resume_step)))
        if logging.wandb_project and logging.wandb_mode != "disabled":
            from megatron_gnmr.observe.wandb_logger import WandbLogger

            loggers.append(every_tensorboard_interval(WandbLogger(
                Path(run_dir), config.to_dict(), logging.wandb_project, logging.wandb_exp_name,
                logging.wandb_entity, logging.wandb_mode, logging.wandb_group)))
        if logging.tensorboard_dir:
            from megatron_gnmr.observe.tensorboard_logger import TensorBoardLogger

            from megatron_gnmr.observe.dashboard import tensorboard_layout

            loggers.append(every_tensorboard_interval(TensorBoardLogger(
                Path(logging.tensorboard_dir), tensorboard_layout(config.to_dict()))))
    except BaseException:
        MultiLogger(loggers).close()
        raise
    return MultiLogger(loggers)
