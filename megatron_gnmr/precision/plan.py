"""PrecisionPlan: which units run the recovery path in the current step.

The controller decides at the end of step t; `advance` installs that decision as the plan
for step t+1 and is only called between steps, so a plan never changes mid-step and a
unit's backward always runs the path of its forward. Precision backends read
`is_recovery(unit)` on each forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrecisionPlan:
    unit_names: list[str]
    recovery: frozenset[int] = field(default_factory=frozenset)
    step: int = 0  # the training step this plan applies to (1-based)

    def advance(self, recovery: tuple[int, ...], step: int) -> None:
        self.recovery = frozenset(recovery)
        self.step = step

    def is_recovery(self, unit: int) -> bool:
        return unit in self.recovery

    def recovery_names(self) -> list[str]:
        return [self.unit_names[u] for u in sorted(self.recovery)]

    def state_dict(self) -> dict:
        return {"recovery": sorted(self.recovery), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.recovery = frozenset(state["recovery"])
        self.step = state["step"]
