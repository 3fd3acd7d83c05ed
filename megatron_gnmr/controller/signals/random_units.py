"""`random` (a baseline): every unit a candidate with a seeded uniform score in [1, 2), so
at a budget (`--gnmr-budget-rate`) it recovers units at random. Resumable: its generator's
state is checkpointed."""

from __future__ import annotations

import numpy as np

from megatron_gnmr.controller.signals.base import Observations, RiskSignal


class RandomSignal(RiskSignal):
    name = "random"

    def __init__(self, unit_names: list[str], settings: dict):
        super().__init__(unit_names, settings)
        self.rng = np.random.default_rng(settings["seed"])

    def scores(self, observations: Observations) -> np.ndarray:
        return 1.0 + self.rng.random(len(self.unit_names))

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
