"""The alarm book: one detector per monitored signal, alarms returned as events (SPEC 7.3).

Which detector watches a signal is the run's `--monitor-detector` (see
`monitors/detectors`). With `reference`, a signal the reference runs never logged falls
back to the trend model, and its events say so (`detector` in every event).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gnmr.monitors.config import DEFAULTS  # the settings' one home
from megatron_gnmr.monitors.contracts import Detector, SignalKey
from megatron_gnmr.monitors.detectors import DETECTORS, ReferenceProfile
from megatron_gnmr.monitors.families import failure_direction


@dataclass
class AlarmBook:
    detector: str = "trend"
    band: float = DEFAULTS.monitor_band
    patience: int = DEFAULTS.monitor_patience
    baseline_samples: int = DEFAULTS.monitor_baseline_samples
    trend_window: int = DEFAULTS.monitor_trend_window
    trend_horizon: int = DEFAULTS.monitor_trend_horizon
    trend_axis: str = "log"
    reference_smooth: int = DEFAULTS.monitor_reference_smooth
    one_sided: bool = True
    """Alarm only on a signal's failure side (`families.failure_direction`); False: both."""
    references: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    """Signal key -> one {step: value} per healthy reference run (`reference` detector)."""
    signals: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.detector not in DETECTORS:
            raise ValueError(f"monitor detector must be one of {', '.join(DETECTORS)}, got "
                             f"{self.detector!r}")
        self.profiles: dict[str, ReferenceProfile] = {}

    def reference_profile(self, key: str) -> ReferenceProfile:
        if key not in self.profiles:
            self.profiles[key] = ReferenceProfile.from_series(
                self.references[key], self.reference_smooth, min_relative_spread=0.01)
        return self.profiles[key]

    def new_detector(self, key: str) -> Detector:
        """The run's detector for one signal (`key`: its `SignalKey.alarm`)."""
        kind = self.detector
        if kind == "reference" and not self.references.get(key):
            kind = "trend"  # a signal the references never logged
        direction = failure_direction(SignalKey.from_alarm(key).name) if self.one_sided else 0
        return DETECTORS[kind].for_signal(key, self, band=self.band, patience=self.patience,
                                          direction=direction)

    def observe(self, step: int, family: str, layer: int | None, name: str,
                value: float) -> dict | None:
        key = SignalKey(family, layer, name).alarm
        detector = self.signals.get(key)
        if detector is None:
            detector = self.signals[key] = self.new_detector(key)
        alarm = detector.update(step, value)
        if alarm is None:
            return None
        return {"monitor": family, "layer": layer, "signal": name, "value": value,
                "detector": detector.kind, **alarm}

    def state_dict(self) -> dict:
        return {key: {"kind": d.kind, "state": d.state_dict()} for key, d in self.signals.items()}

    def load_state_dict(self, state: dict) -> None:
        self.signals = {}
        for key, saved in state.items():
            detector = self.signals[key] = self.new_detector(key)
            if detector.kind != saved["kind"]:
                raise ValueError(f"monitor state of {key} was written by the {saved['kind']} "
                                 f"detector, this run uses {detector.kind}")
            detector.load_state_dict(saved["state"])
