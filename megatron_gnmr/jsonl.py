"""The run's JSONL logs (metrics.jsonl, gnmr_trace.jsonl): read what is complete, and cut a
log back to a resumed step, atomically. Shared by the loggers, the trace, the monitors'
reference runs and the report, so a line cut by a crash is handled the same everywhere."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    """Every complete record (a JSON object) of a JSONL log: a line cut by a crash, the one
    being written, bytes that are not text and JSON that is not an object are skipped."""
    records = []
    for line in Path(path).read_bytes().decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash, or the one being written right now
        if isinstance(record, dict):
            records.append(record)
    return records


def keep_records_up_to(path: Path, step: int) -> None:
    """Rewrite a JSONL log (atomically) with only its complete records of steps <= `step`
    (records without a step, such as a trace header, count as step 0)."""
    kept = []
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if record.get("step", 0) <= step:
            kept.append(line + "\n")  # as written: a resumed log stays byte-identical
    partial = Path(path).with_name(Path(path).name + ".partial")
    partial.write_text("".join(kept))
    os.replace(partial, path)
