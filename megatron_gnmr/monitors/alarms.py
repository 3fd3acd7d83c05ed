"""The alarm book: one detector per monitored signal, alarms returned as events (SPEC 7.3).

Which detector watches a signal is the run's `--monitor-detector` (see
`monitors/detectors`). With `reference`, a signal the reference runs never logged falls
back to the trend model, and its events say so (`detector` in every event).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gnmr.monitors.detectors import (
    DETECTORS,
    OnlineBand,
    ReferenceBand,
    ReferenceProfile,
    TrendModel,
)

# The signals each family's alarms watch (the others are logged for context only).
ALARM_SIGNALS = {
    "attention": ("H_D2_mean", "H_dWq", "H_dWk"),
    "router": ("entropy_mean", "weight_similarity", "load_max_over_mean"),
}

# The side on which each signal fails (SPEC 7): update spectra collapse (entropy falls),
# routing collapses (entropy falls, router rows align, load concentrates), loss rises.
# A healthy run drifting the other way is not an alarm.
FAILURE_DIRECTION = {
    "H_D2_mean": -1, "H_dWq": -1, "H_dWk": -1,
    "entropy_mean": -1, "weight_similarity": +1, "load_max_over_mean": +1,
    "train_loss": +1,
}


@dataclass
class AlarmBook:
    detector: str = "trend"
    band: float = 4.0
    patience: int = 5
    baseline_samples: int = 16
    trend_window: int = 16
    trend_horizon: int = 12
    trend_axis: str = "log"
    reference_smooth: int = 4
    one_sided: bool = True
    """Alarm only on a signal's failure side (`FAILURE_DIRECTION`); False: both sides."""
    references: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    """Signal key -> one {step: value} per healthy reference run (`reference` detector)."""
    signals: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.detector not in DETECTORS:
            raise ValueError(f"monitor detector must be one of {DETECTORS}, got "
                             f"{self.detector!r}")
        self.profiles: dict[str, ReferenceProfile] = {}

    def new_detector(self, key: str):
        shared = {"band": self.band, "patience": self.patience,
                  "direction": FAILURE_DIRECTION.get(key.split("/")[-1], 0)
                  if self.one_sided else 0}
        if self.detector == "reference" and self.references.get(key):
            if key not in self.profiles:
                self.profiles[key] = ReferenceProfile.from_series(
                    self.references[key], self.reference_smooth, min_relative_spread=0.01)
            return ReferenceBand(self.profiles[key], smooth=self.reference_smooth, **shared)
        if self.detector == "online":
            return OnlineBand(baseline_samples=self.baseline_samples, **shared)
        return TrendModel(window=self.trend_window, horizon=self.trend_horizon,
                          axis=self.trend_axis, **shared)

    def observe(self, step: int, family: str, layer: int | None, name: str,
                value: float) -> dict | None:
        key = f"{family}/{name}" if layer is None else f"{family}/layer{layer}/{name}"
        detector = self.signals.get(key)
        if detector is None:
            detector = self.signals[key] = self.new_detector(key)
        alarm = detector.update(step, value)
        if alarm is None:
            return None
        return {"monitor": family, "layer": layer, "signal": name, "value": value,
                "detector": _kind(detector), **alarm}

    def state_dict(self) -> dict:
        return {key: {"kind": _kind(d), "state": d.state_dict()}
                for key, d in self.signals.items()}

    def load_state_dict(self, state: dict) -> None:
        self.signals = {}
        for key, saved in state.items():
            detector = self.signals[key] = self.new_detector(key)
            if _kind(detector) != saved["kind"]:
                raise ValueError(f"monitor state of {key} was written by the {saved['kind']} "
                                 f"detector, this run uses {_kind(detector)}")
            detector.load_state_dict(saved["state"])


def _kind(detector) -> str:
    return {OnlineBand: "online", TrendModel: "trend", ReferenceBand: "reference"}[
        type(detector)]
