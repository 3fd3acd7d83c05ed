"""RunState: where the run is; checkpointed with everything else.

The data position is the step itself: step `s` reads global samples
`[s * global_batch, (s + 1) * global_batch)` (`data/datasets.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from megatron_gnmr.training.divergence import DivergenceRule


@dataclass
class RunState:
    step: int = 0  # optimizer steps completed
    last_loss: float = float("nan")
    nonfinite_streak: int = 0  # consecutive steps skipped for non-finite gradients
    divergence: DivergenceRule = field(default_factory=DivergenceRule)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.last_loss = state["last_loss"]
        self.nonfinite_streak = state["nonfinite_streak"]
        self.divergence = DivergenceRule(**state.get("divergence", {}))  # older: none
