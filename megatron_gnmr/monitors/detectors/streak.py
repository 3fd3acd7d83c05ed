"""The alarm rule every detector shares: `patience` consecutive samples outside, fire once;
and what "outside" means on a signal whose failure has a known direction.

An alarm fires when the streak of outside samples reaches `patience`; it can fire again only
after the signal has come back inside (so a signal that stays out raises one event).
"""

from __future__ import annotations

from dataclasses import dataclass


def beyond(value: float, expected: float, allowed: float, direction: int) -> bool:
    """Is `value` more than `allowed` away from `expected` on the watched side?
    direction +1: only above counts, -1: only below, 0: either side."""
    deviation = value - expected
    if direction:
        deviation *= direction
    else:
        deviation = abs(deviation)
    return not deviation <= allowed  # NaN counts as beyond


class FiresByStreak:
    """A detector whose alarm state is its `rule` (a Streak): `firing` as the
    `contracts.Detector` Protocol asks."""

    rule: "Streak"

    @property
    def firing(self) -> bool:
        return self.rule.firing


@dataclass
class Streak:
    patience: int
    streak: int = 0
    firing: bool = False
    alarms: int = 0

    def push(self, outside: bool) -> bool:
        """Record one checked sample; True when it raises an alarm."""
        self.streak = self.streak + 1 if outside else 0
        if not outside:
            self.firing = False
        if self.streak >= self.patience and not self.firing:
            self.firing = True
            self.alarms += 1
            return True
        return False

    def state_dict(self) -> dict:
        """Counters only: `patience` is a setting, taken from the resumed run's flags."""
        return {"streak": self.streak, "firing": self.firing, "alarms": self.alarms}

    def load_state_dict(self, state: dict) -> None:
        self.streak, self.firing, self.alarms = (state["streak"], state["firing"],
                                                 state["alarms"])
