"""What the monitor suite asks of a monitor and of a detector, and the one spelling of a
monitored signal's name.

A monitor family (`families.py`) builds a `Monitor`; an alarm detector (`detectors/`) is a
`Detector`. These Protocols list everything the suite, the alarm book and the controller's
`monitor` risk signal use: a class that has these members plugs in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol


class Monitor(Protocol):
    def before_step(self, step: int) -> None:
        """Before the forward of the 1-based `step` (arm hooks for a check step)."""

    def after_step(self, step: int) -> None:
        """After the optimizer step of `step` (take snapshots)."""

    def reads_weights(self, step: int) -> bool:
        """Whether `after_step(step)` or a check at `step` reads the model's weights, which
        must then be whole (`training/overlap.py` waits for the parameter gather)."""

    def measure(self) -> dict[int, dict[str, float]] | None:
        """At a check step: {0-based global layer: {signal: value}}, the same on every rank
        (None: nothing to compare with yet)."""

    def state_dict(self) -> dict:
        """What a resume needs (snapshots, counters)."""

    def load_state_dict(self, state: dict) -> None: ...


class Detector(Protocol):
    kind: ClassVar[str]
    """Its `--monitor-detector` name."""

    @classmethod
    def check(cls, monitor) -> None:
        """Before the run: whether the monitor section (`MonitorConfig`) gives this detector
        what it needs; a ValueError that names the flags when not."""

    @classmethod
    def for_signal(cls, key: str, book, **shared) -> "Detector":
        """The detector of one signal (`key`: its `SignalKey.alarm`, how the alarm book and
        the reference runs name it); `book` is the run's AlarmBook (its settings and
        reference runs), `shared` the settings every detector takes: band, patience and the
        failure direction."""

    def update(self, step: int, value: float) -> dict | None:
        """One sample: the new alarm's `expected` and `band` when it fires, else None."""

    @property
    def firing(self) -> bool:
        """Whether the signal is outside its band now (an alarm that fired and has not
        cleared): what the controller's `monitor` risk signal reads."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class SignalKey:
    """A monitored signal: its family, its 0-based layer (None: a model-wide signal) and its
    name. Logged as `metric` (`monitor/attention/layer3/H_D2_mean`), kept in the alarm book
    as `alarm` (`attention/layer3/H_D2_mean`)."""

    family: str
    layer: int | None
    name: str

    METRIC_PREFIX: ClassVar[str] = "monitor/"

    @property
    def alarm(self) -> str:
        where = "" if self.layer is None else f"layer{self.layer}/"
        return f"{self.family}/{where}{self.name}"

    @property
    def metric(self) -> str:
        return self.METRIC_PREFIX + self.alarm

    @classmethod
    def from_alarm(cls, text: str) -> "SignalKey":
        parts = text.split("/")
        if len(parts) == 3 and _layer_number(parts[1]) is not None:
            return cls(parts[0], _layer_number(parts[1]), parts[2])
        if len(parts) == 2:
            return cls(parts[0], None, parts[1])
        raise ValueError(f"not a monitor signal key: {text!r}")

    @classmethod
    def from_metric(cls, text: str) -> "SignalKey | None":
        """The key of a logged metric name, or None for anything else."""
        if not text.startswith(cls.METRIC_PREFIX):
            return None
        try:
            return cls.from_alarm(text.removeprefix(cls.METRIC_PREFIX))
        except ValueError:
            return None


def _layer_number(part: str) -> int | None:
    digits = part.removeprefix("layer")
    return int(digits) if part.startswith("layer") and digits.isdigit() else None
