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
