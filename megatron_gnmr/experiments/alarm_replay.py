"""Replay a run's logged monitor signals through an alarm detector, offline.

Monitors only read, so a run's `metrics.jsonl` holds everything any detector would have
seen live: feeding it through the same `AlarmBook` a live run uses gives the alarms that run
would have raised with that detector (a test checks a live run against its replay). This is
how one set of fault runs compares several detectors, on the mechanism signals and on the
training loss.
"""

from __future__ import annotations

from megatron_gnmr.monitors.alarms import AlarmBook
from megatron_gnmr.monitors.detectors.reference_runs import monitor_series


def replay_alarms(records: list[dict], book: AlarmBook) -> list[dict]:
    """Alarm events (with `step` and `key`) the book raises over a run's logged signals."""
    events = []
    for step, family, layer, name, value in monitor_series(records):
        event = book.observe(step, family, layer, name, value)
        if event is not None:
            key = f"{family}/{name}" if layer is None else f"{family}/layer{layer}/{name}"
            events.append({"step": step, "key": key, **event})
    return events
