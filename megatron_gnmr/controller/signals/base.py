"""What every risk signal is: per-unit scores from one step's observations.

A signal turns `Observations` (all-reduced, identical on every rank) into one score per unit,
> 1 meaning "risky". It says which observations it needs (`observes`: measured quantities by
their registry name, `precision/measurements/`, or `alarmed`), so the controller asks the
precision probes only for what some signal reads, and the trace records exactly what replay
needs to score the signal again offline. Its knobs are its own `settings_class`: a dataclass
whose fields (defaults and ranges declared with `limits.limit`, a docstring each, an optional
`check()` across them) join the gnmr section as `--gnmr-<field>` flags and YAML keys, and
replay's sweepable settings; they arrive as the run's signal settings (a plain dict by field
name, also recorded in the trace header). Anything it must remember between steps goes in
`state_dict` (checkpointed, covered by the agreement digest).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Mapping, Protocol

import numpy as np


@dataclass(frozen=True)
class Observations:
    """What one step offers the signals."""

    measured: Mapping[str, np.ndarray] = field(default_factory=dict)
    """[units] values of the step's measured quantities, by registry name (`qerr`: the
    low-cost path's worst relative rounding error; `oracle`: its weight gradient's true
    relative error): those some signal of the run reads or `--gnmr-measure` names."""
    alarmed: frozenset[str] = frozenset()
    """Unit-name prefixes under a monitor alarm firing now (`layers.3.self_attention.`):
    each monitor family says which units its alarm names (monitors/families.py)."""


class RiskSignal(Protocol):
    """The written contract of a risk signal; subclass it and implement `scores` (`observes`
    names the observations it reads; the rest has defaults)."""

    name = ""
    observes: tuple[str, ...] = ()
    settings_class: type | None = None

    def __init__(self, unit_names: list[str], settings: dict):
        self.unit_names = unit_names
        self.settings = settings

    @abstractmethod
    def scores(self, observations: Observations) -> np.ndarray:
        """One score per unit for this step; > 1 means risky (NaN: no opinion)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Hold:
    """The one way a signal keeps a unit risky after its breach: for `decisions` more decisions
    once its score falls back to <= 1 (-1: for the rest of the run; 0: only while breached).
    A held unit scores what it scored at its last breach, unless the caller says otherwise.
    NaN scores never breach."""

    def __init__(self, units: int, decisions: int):
        self.decisions = decisions
        self.left = np.zeros(units, dtype=np.int64)  # decisions still held (-1: for good)
        self.score = np.zeros(units)  # each unit's score at its last breach

    def __call__(self, score: np.ndarray, held_score: np.ndarray | None = None) -> np.ndarray:
        """This decision's scores, held ones replaced (by `held_score` where given)."""
        breached = score > 1.0  # NaN compares False
        holding = ~breached & (self.left != 0)
        out = np.where(holding, self.score if held_score is None else held_score, score)
        self.left[holding & (self.left > 0)] -= 1
        self.left[breached] = self.decisions
        self.score[breached] = score[breached]
        return out

    def state_dict(self) -> dict:
        return {"left": self.left.copy(), "score": self.score.copy()}

    def load_state_dict(self, state: dict) -> None:
        self.left = np.array(state["left"], dtype=np.int64)
        self.score = np.array(state["score"], dtype=np.float64)


def legacy_hold(state: dict) -> dict:
    """A signal's hold as checkpoints of before `Hold` kept it (`held`, `held_score`)."""
    held = np.asarray(state["held"], dtype=np.int64)
    return {"left": held, "score": state.get("held_score", np.zeros(held.shape))}
