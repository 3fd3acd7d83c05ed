"""Reading healthy reference runs for the reference band: their signals and their configs.

A run's signals are the alarm-watched monitor values of its `metrics.jsonl`, in log order,
plus the training loss averaged over each check interval (`LOSS_KEY`), so "the loss's own
band" can be judged by the same detectors as the mechanism signals.

A reference is only meaningful for the same model, data and schedule, so each reference's
`config.json` (written by every run) is compared with the live run's on the fields that
shape the signals; differences are warnings (the user may know better), a missing or
unreadable run directory is an error naming it.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from megatron_gnmr.errors import UserError
from megatron_gnmr.monitors.contracts import SignalKey
from megatron_gnmr.monitors.families import FAMILIES
from megatron_gnmr.jsonl import read_jsonl

LOSS_KEY = "loss/train_loss"

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


def monitor_series(records: list[dict]) -> list[tuple[int, str, int | None, str, float]]:
    """(step, family, layer, name, value) of every alarm-watched monitor value, in log order,
    plus the training loss averaged over each check interval."""
    out, losses = [], []
    for record in records:
        if not isinstance(record.get("step"), int):
            continue  # not a step's record (a header, or not ours)
        if "train/loss" in record:
            loss = record["train/loss"]
            losses.append(loss if isinstance(loss, (int, float)) else math.nan)
        checked = False
        for key, value in record.items():
            signal = SignalKey.from_metric(key)
            if signal is None or signal.layer is None:
                continue  # not a per-layer monitor signal
            if signal.family in FAMILIES and signal.name in FAMILIES[signal.family].alarm_signals:
                number = value if isinstance(value, (int, float)) else math.nan
                out.append((record["step"], signal.family, signal.layer, signal.name,
                            float(number)))
                checked = True
        if checked and losses:
            out.append((record["step"], "loss", None, "train_loss", statistics.fmean(losses)))
            losses = []
    return out


def signals_by_key(runs: list[list[dict]]) -> dict[str, list[dict[int, float]]]:
    """Signal key -> one {step: value} per run, from already-read runs (loss included)."""
    signals: dict[str, list[dict[int, float]]] = {}
    for index, records in enumerate(runs):
        for step, family, layer, name, value in monitor_series(records):
            key = f"{family}/{name}" if layer is None else f"{family}/layer{layer}/{name}"
            series = signals.setdefault(key, [])
            while len(series) <= index:
                series.append({})
            series[index][step] = value
    return signals


def load_reference_signals(run_dirs: list[str]) -> dict[str, list[dict[int, float]]]:
    """signal key ('attention/layer0/H_D2_mean') -> one {step: value} per reference run."""
    runs = []
    for run_dir in run_dirs:
        records = read_jsonl(_metrics_path(run_dir))
        if not any(isinstance(r.get("step"), int) for r in records):
            raise UserError(f"--monitor-reference {run_dir}: its metrics.jsonl holds no step "
                            "records (a reference is the --save directory of a finished "
                            "healthy run)")
        runs.append(records)
    return signals_by_key(runs)


def config_mismatches(run_dirs: list[str], live: dict) -> list[str]:
    """One line per reference field that differs from the live run's (or is unknown)."""
    lines = []
    for run_dir in run_dirs:
        path = Path(run_dir) / "config.json"
        if not path.is_file():
            lines.append(f"{run_dir}: no config.json, cannot check it matches this run")
            continue
        try:
            reference = json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError):
            reference = None
        if not isinstance(reference, dict):
            lines.append(f"{run_dir}: config.json is not a run config, cannot check it "
                         "matches this run")
            continue
        for section, names in COMPARED_FIELDS.items():
            ours, theirs = live.get(section, {}), reference.get(section)
            theirs = theirs if isinstance(theirs, dict) else {}
            for name in names or sorted(set(ours) | set(theirs)):
                if ours.get(name) != theirs.get(name):
                    lines.append(f"{run_dir}: {section}.{name} = {theirs.get(name)!r}, "
                                 f"this run has {ours.get(name)!r}")
    return lines
