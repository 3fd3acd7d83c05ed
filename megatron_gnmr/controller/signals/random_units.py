"""`random` (a baseline): every unit a candidate with a seeded uniform score in [1, 2), so
at a budget (`--gnmr-budget-rate`) it recovers units at random. Resumable: its generator's
state is checkpointed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_gnmr.controller.signals.base import Observations, RiskSignal
from megatron_gnmr.limits import limit


@dataclass
class RandomSettings:
    selection_seed: int = limit(0, ge=0, lt=2**63)
    """random baseline: seed of its draws (added to the run's --seed)."""


class RandomSignal(RiskSignal):
    name = "random"
    settings_class = RandomSettings

    def __init__(self, unit_names: list[str], settings: dict):
        super().__init__(unit_names, settings)
        # Traces recorded before the settings were the signals' own hold the sum as `seed`.
        seed = settings["selection_seed"] + settings["run_seed"] if "run_seed" in settings \
            else settings["seed"]
        self.rng = np.random.default_rng(seed)

    def scores(self, observations: Observations) -> np.ndarray:
        return 1.0 + self.rng.random(len(self.unit_names))

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
