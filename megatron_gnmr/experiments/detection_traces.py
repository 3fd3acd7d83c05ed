"""A run's detection trace: what every detector reads, per step and core attention, kept small
enough to commit (`docs/runs/SCENARIO/traces/RUN.npz`), so any detector's first alarm on the
run can be computed again from the repository alone.

A controlled run is bitwise its no-budget twin until its first action, so a detector's first
alarm (step, layer) on a dying run, and whether it ever fires on a healthy run, are functions
of the twin's and the healthy run's traces. Kept per step: the units' gradient norms (GNMR),
every measured quantity the run traced (`attention_error`, `attention_bias`, `fp8_underflow`,
`fp8_mse`), which units a monitor alarm named (the spectral detector, live) and the training
loss (for the onset of harm); per run: the unit names, the policy config and signal settings
it was traced with, the faulted layers, where it diverged, and its provenance. Values are
stored in float32 (a detector's threshold would have to fall within 1e-7 of a value for that
to change a comparison).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_gnmr.controller.trace import Trace, read_trace
from megatron_gnmr.errors import UserError
from megatron_gnmr.experiments.closed_loop_runs import run_summary
from megatron_gnmr.jsonl import read_jsonl


@dataclass
class DetectionTrace:
    """One run's detection trace: `trace` replays like the live run's gnmr_trace.jsonl."""

    name: str
    trace: Trace
    loss: np.ndarray  # [steps] training loss of steps 1..n
    fault_layers: list[int]  # [] on a healthy run
    diverged_at: int | None
    provenance: dict

    @property
    def steps(self) -> int:
        return len(self.trace.steps)


def _fault_layers(run_dir: Path) -> list[int]:
    start = next((r for r in read_jsonl(run_dir / "metrics.jsonl")
                  if r.get("event") == "start"), {})
    return list(start.get("attention_fault_layers", []))


def _alarmed(trace: Trace) -> np.ndarray:
    """[steps, units]: whether an alarm firing in that step named the unit."""
    out = np.zeros(trace.norms.shape, dtype=bool)
    for step, prefixes in enumerate(trace.alarmed or ()):
        prefixes = tuple(prefixes)
        if prefixes:
            out[step] = [name.startswith(prefixes) for name in trace.units]
    return out


def write(run_dir: Path, path: Path) -> None:
    """The detection trace of a finished (or diverged) run directory."""
    trace = read_trace(str(run_dir / "gnmr_trace.jsonl"))
    losses = {r["step"]: r["train/loss"] for r in read_jsonl(run_dir / "metrics.jsonl")
              if "train/loss" in r}
    steps = len(trace.steps)
    if trace.steps != list(range(1, steps + 1)) or any(s not in losses for s in trace.steps):
        raise UserError(f"{run_dir}: its trace does not cover steps 1..{steps} with a loss each "
                        "(record it with --gnmr-trace-interval 1 and --log-interval 1)")
    summary = run_summary(run_dir)
    meta = {"name": run_dir.name, "units": trace.units, "config": trace.config,
            "signal_settings": trace.signal_settings, "measured": sorted(trace.measured),
            "fault_layers": _fault_layers(run_dir), "diverged_at": summary["diverged_at"],
            "provenance": {k: summary.get(k) for k in ("command", "commits", "packages", "cpu",
                                                        "launches")}}
    arrays = {f"measured_{name}": values.astype(np.float32)
              for name, values in trace.measured.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()  # written whole, then moved: a reader never sees half a file
    np.savez_compressed(buffer, meta=np.array(json.dumps(meta)),
                        norms=trace.norms.astype(np.float32),
                        alarmed=np.packbits(_alarmed(trace), axis=None),
                        loss=np.array([losses[s] for s in trace.steps], dtype=np.float32),
                        **arrays)
    partial = path.with_suffix(".partial")
    partial.write_bytes(buffer.getvalue())
    partial.replace(path)


def read(path: Path) -> DetectionTrace:
    with np.load(path) as data:
        meta = json.loads(str(data["meta"]))
        units, norms = meta["units"], data["norms"].astype(np.float64)
        steps = norms.shape[0]
        named = np.unpackbits(data["alarmed"], count=norms.size).reshape(norms.shape)
        measured = {key[len("measured_"):]: data[key].astype(np.float64)
                    for key in data.files if key.startswith("measured_")}
        loss = data["loss"].astype(np.float64)
    alarmed = [frozenset(u for u, hit in zip(units, row) if hit) for row in named]
    trace = Trace(units, meta["config"], list(range(1, steps + 1)), norms,
                  [()] * steps, measured, alarmed, meta["signal_settings"])
    return DetectionTrace(meta["name"], trace, loss, meta["fault_layers"],
                          meta["diverged_at"], meta["provenance"])


def mean_probe_cost(loaded: list[DetectionTrace]) -> float | None:
    """The kernel probe's FLOPs over the attention's, the mean over traces that measured it
    (each trace's own mean over its unit-steps); None where none did."""
    costs = [float(np.nanmean(t.trace.measured["kernel_probe_cost"])) for t in loaded
             if "kernel_probe_cost" in t.trace.measured]
    costs = [c for c in costs if np.isfinite(c)]
    return float(np.mean(costs)) if costs else None
