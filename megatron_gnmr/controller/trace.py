"""The per-step controller trace: `gnmr_trace.jsonl` in the run directory.

Line 1 is a header (unit names, the policy config); then one record per traced step with
every unit's norm (exact float repr, `null` for NaN, "inf"/"-inf") and the decided recovery
set. With `trace_interval` 1 the trace holds everything the policy saw, so `megatron-gnmr
replay` re-runs the policy and must reproduce the recorded decisions exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Iterator

import numpy as np

from megatron_gnmr.controller.config import GNMRConfig
from megatron_gnmr.controller.policy import Decision
from megatron_gnmr.errors import UserError
from megatron_gnmr.jsonl import keep_records_up_to
from megatron_gnmr.precision.measurements import MEASUREMENTS


def _encode(value: float):
    if math.isnan(value):
        return None
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _decode(value) -> float:
    if value is None:
        return math.nan
    return float(value)


FORMAT = 2  # the header's "format": records observations (measured quantities, alarmed)


class TraceWriter:
    def __init__(self, path: Path, unit_names: list[str], config: GNMRConfig, resume_step: int,
                 signal_settings: dict, unit_costs: list[float] | None = None,
                 measured: tuple[str, ...] = ()):
        self.path = path
        if path.exists() and resume_step == 0:  # a fresh start: another run's trace goes
            path.unlink()
        if path.exists():  # steps past the checkpoint (or a crash's cut line) are redone
            keep_records_up_to(path, resume_step)
        new = not path.exists() or path.stat().st_size == 0
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", buffering=1)
        if new:
            header = {"type": "header", "format": FORMAT, "units": unit_names,
                      "config": dataclasses.asdict(config), "signal_settings": signal_settings,
                      "measured": list(measured),
                      **({"unit_costs": unit_costs} if unit_costs is not None else {})}
            self.file.write(json.dumps(header) + "\n")

    def write(self, decision: Decision, observed: dict | None = None) -> None:
        """One step: the norms, the decided set, and what the risk signals observed (per-unit
        arrays of the measured quantities, by name; `alarmed`: unit-name prefixes) so replay
        can score them."""
        record = {"step": decision.step, "norms": [_encode(v) for v in decision.norms.tolist()],
                  "recovery": list(decision.recovery)}
        for name, values in (observed or {}).items():
            record[name] = list(values) if name == "alarmed" else \
                [_encode(v) for v in np.asarray(values, dtype=np.float64).tolist()]
        self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.file.close()


@dataclasses.dataclass
class Trace:
    units: list[str]
    config: dict
    steps: list[int]
    norms: np.ndarray  # [steps, units]
    recovery: list[tuple[int, ...]]
    measured: dict[str, np.ndarray]
    """The measured quantities' values ([steps, units]) by name, when the run measured them
    (`precision/measurements/`)."""
    alarmed: list[frozenset[str]] | None
    """Per step, the unit-name prefixes under a firing monitor alarm (when recorded)."""
    signal_settings: dict
    """How the live run scored its signals (`GNMRRunConfig.signal_settings`)."""
    unit_costs: np.ndarray | None = None
    """What each unit spends of a budget in FLOPs (`GNMRPolicy`), when recorded."""


def read_trace(path: str) -> Trace:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"trace {path}: no such file (it is gnmr_trace.jsonl in a run directory)")
    header, steps, norms, recovery = None, [], [], []
    measured_names: list[str] = []
    arrays: dict[str, list] = {}
    alarmed: list[frozenset[str]] = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == 1:
                raise UserError(f"trace {path}: line 1 is not JSON") from None
            continue  # a line cut by a crash: keep what is complete
        if record.get("type") == "header":
            header = record
            # Traces from before the header listed them hold the registry's names.
            measured_names = header.get("measured", list(MEASUREMENTS))
            continue
        steps.append(record["step"])
        norms.append([_decode(v) for v in record["norms"]])
        recovery.append(tuple(record["recovery"]))
        for name in measured_names:
            if name in record:
                arrays.setdefault(name, []).append([_decode(v) for v in record[name]])
        if "alarmed" in record:
            alarmed.append(frozenset(record["alarmed"]))
    if header is None:
        raise UserError(f"trace {path}: no header line (not a gnmr_trace.jsonl?)")
    if header.get("format") != FORMAT:
        raise UserError(f"trace {path}: format {header.get('format')}, this version reads "
                        f"format {FORMAT}; record it again with this version")
    units = len(header["units"])
    return Trace(header["units"], header["config"], steps,
                 np.asarray(norms, dtype=np.float64).reshape(len(steps), units), recovery,
                 {name: np.asarray(rows, dtype=np.float64).reshape(-1, units)
                  for name, rows in arrays.items() if len(rows) == len(steps)},
                 alarmed if len(alarmed) == len(steps) else None, header["signal_settings"],
                 np.asarray(header["unit_costs"], dtype=np.float64)
                 if "unit_costs" in header else None)


def iter_gaps(steps: list[int]) -> Iterator[int]:
    for previous, current in zip(steps, steps[1:]):
        if current != previous + 1:
            yield current
