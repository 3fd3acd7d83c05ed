"""RunState: where the run is (step, data position); checkpointed with everything else."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class RunState:
    step: int = 0  # optimizer steps completed
    consumed_samples: int = 0  # the data position: step * global batch size
    last_loss: float = float("nan")
    nonfinite_streak: int = 0  # consecutive steps skipped for non-finite gradients

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.consumed_samples = state["consumed_samples"]
        self.last_loss = state["last_loss"]
        self.nonfinite_streak = state.get("nonfinite_streak", 0)
