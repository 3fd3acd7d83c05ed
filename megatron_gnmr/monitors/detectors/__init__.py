"""Alarm detectors for monitor signals: each turns a stream of (step, value) into alarms.

| detector | expected value of a sample | needs |
|---|---|---|
| `trend` (default) | a robust line through the signal's own recent past, extrapolated | nothing |
| `reference` | the band of healthy reference runs at the same step | `--monitor-reference` |
| `online` | the band of the signal's own first samples (SPEC 7.3 as first built) | nothing |

All share the alarm rule (`Streak`: `--monitor-patience` consecutive samples outside) and
the band width in noise units (`--monitor-band`). Every detector has `update(step, value)`
returning the alarm's `expected`/`band` or None, a `state_dict` of counters (its settings come
from the run's flags, also on resume), a `kind` and a `for_signal(key, book, **shared)`
constructor. Adding a detector is one file and one entry in `DETECTORS`.
"""

from megatron_gnmr.monitors.detectors.online import OnlineBand
from megatron_gnmr.monitors.detectors.reference import ReferenceBand, ReferenceProfile
from megatron_gnmr.monitors.detectors.trend import TrendModel

DETECTORS = {detector.kind: detector for detector in (TrendModel, ReferenceBand, OnlineBand)}

__all__ = ["DETECTORS", "OnlineBand", "ReferenceBand", "ReferenceProfile", "TrendModel"]
