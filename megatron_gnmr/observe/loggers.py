"""Loggers behind one interface, so the training loop never asks which ones are on.

`MultiLogger` fans out to console and JSONL (W&B and TensorBoard plug in the same way).
Ranks other than the logging rank get a `NullLogger`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Protocol


class Logger(Protocol):
    def log(self, step: int, metrics: dict) -> None: ...
    def event(self, step: int, kind: str, payload: dict) -> None: ...
    def close(self) -> None: ...


class NullLogger:
    def log(self, step: int, metrics: dict) -> None:
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

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", buffering=1)

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, "time": round(time.time(), 3)}
        record.update({k: _finite_or_none(v) for k, v in metrics.items()})
        self.file.write(json.dumps(record) + "\n")

    def event(self, step: int, kind: str, payload: dict) -> None:
        self.log(step, {"event": kind, **payload})

    def close(self) -> None:
        self.file.close()


class ConsoleLogger:
    """One line per logged step: step/total, loss, lr, grad norm, tokens/s, step time, ETA."""

    def __init__(self, total_steps: int, stream=sys.stdout):
        self.total_steps = total_steps
        self.stream = stream

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
            print(" | ".join(parts), file=self.stream, flush=True)
        if "valid/loss" in metrics:
            print(f"validation at step {step}: loss {metrics['valid/loss']:.4f} "
                  f"ppl {metrics['valid/ppl']:.2f}", file=self.stream, flush=True)

    def event(self, step: int, kind: str, payload: dict) -> None:
        details = ", ".join(f"{k}={v}" for k, v in payload.items())
        print(f"[{kind}] step {step}: {details}", file=self.stream, flush=True)

    def close(self) -> None:
        pass


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class MultiLogger:
    def __init__(self, loggers: list):
        self.loggers = loggers

    def log(self, step: int, metrics: dict) -> None:
        for logger in self.loggers:
            logger.log(step, metrics)

    def event(self, step: int, kind: str, payload: dict) -> None:
        for logger in self.loggers:
            logger.event(step, kind, payload)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
