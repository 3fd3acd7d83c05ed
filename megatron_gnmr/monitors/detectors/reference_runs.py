"""Reading healthy reference runs for the reference band: their signals and their configs.

A reference is only meaningful for the same model, data and schedule, so each reference's
`config.json` (written by every run) is compared with the live run's on the fields that
shape the signals; differences are warnings (the user may know better), a missing or
unreadable run directory is an error naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_gnmr.errors import UserError
from megatron_gnmr.observe.report import read_jsonl

MONITOR_PREFIX = "monitor/"

# The config fields that must agree for a reference run's signals to be comparable.
COMPARED_FIELDS = {
    "model": None,  # every field
    "data": ("data_path", "tokenizer_model"),
    "training": ("micro_batch_size", "global_batch_size", "lr", "min_lr", "lr_warmup_iters",
                 "train_iters", "weight_decay", "clip_grad", "bf16"),
    "monitor": ("monitor_interval", "monitor_delta"),
}


def _metrics_path(run_dir: str) -> Path:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"--monitor-reference {run_dir}: no metrics.jsonl there (a reference "
                        "is the --save directory of a finished healthy run)")
    return path


def load_reference_signals(run_dirs: list[str]) -> dict[str, list[dict[int, float]]]:
    """signal key ('attention/layer0/H_D2_mean') -> one {step: value} per reference run."""
    signals: dict[str, list[dict[int, float]]] = {}
    for index, run_dir in enumerate(run_dirs):
        for record in read_jsonl(_metrics_path(run_dir)):
            for key, value in record.items():
                if key.startswith(MONITOR_PREFIX) and isinstance(value, (int, float)):
                    series = signals.setdefault(key[len(MONITOR_PREFIX):], [])
                    while len(series) <= index:
                        series.append({})
                    series[index][record["step"]] = float(value)
    return signals


def config_mismatches(run_dirs: list[str], live: dict) -> list[str]:
    """One line per reference field that differs from the live run's (or is unknown)."""
    lines = []
    for run_dir in run_dirs:
        path = Path(run_dir) / "config.json"
        if not path.is_file():
            lines.append(f"{run_dir}: no config.json, cannot check it matches this run")
            continue
        reference = json.loads(path.read_text())
        for section, names in COMPARED_FIELDS.items():
            ours, theirs = live.get(section, {}), reference.get(section, {})
            for name in names or sorted(set(ours) | set(theirs)):
                if ours.get(name) != theirs.get(name):
                    lines.append(f"{run_dir}: {section}.{name} = {theirs.get(name)!r}, "
                                 f"this run has {ours.get(name)!r}")
    return lines
