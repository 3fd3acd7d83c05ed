"""TensorBoard: the same scalar names as W&B and JSONL, events as text, and the dashboard
layout as custom scalars (TensorBoard opens on grouped charts: `observe/dashboard.py`)."""

from __future__ import annotations

import json
import numbers
from pathlib import Path


class TensorBoardLogger:
    def __init__(self, log_dir: Path, layout: dict | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))
        if layout:
            self.writer.add_custom_scalars(layout)

    def log(self, step: int, metrics: dict) -> None:
        for key, value in metrics.items():
            if isinstance(value, numbers.Number) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=step)

    def image(self, step: int, key: str, figure) -> None:
        self.writer.add_figure(key, figure, global_step=step, close=False)

    def event(self, step: int, kind: str, payload: dict) -> None:
        self.writer.add_text(f"events/{kind}", json.dumps(payload, default=str), step)

    def close(self) -> None:
        self.writer.close()
