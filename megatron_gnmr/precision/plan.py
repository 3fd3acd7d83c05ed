"""PrecisionPlan and PrecisionRuntime: which path each unit runs in the current step.

The controller decides at the end of step t; `PrecisionPlan.advance` installs that decision
as the plan for step t+1 and is only called between steps, so a plan never changes
mid-step and a unit's backward always runs the path of its forward. Without the controller
the plan is static: every unit low-cost (or, with `--precision-static recovery`, every unit
on the recovery path): the fixed baselines experiments compare against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gnmr.precision.paths import GEMM_ROLES, mixed_path


@dataclass
class PrecisionPlan:
    recovery: frozenset[str] = field(default_factory=frozenset)
    """Unit names on the recovery path in this step."""
    all_recovery: bool = False
    """Static baseline: every unit on the recovery path."""
    always: frozenset[str] = field(default_factory=frozenset)
    """Units on the recovery path in every step (`--precision-config-file`); not part of the
    state: the run's config gives them again on resume."""
    step: int = 0  # the training step this plan applies to (1-based)

    def advance(self, recovery_names, step: int) -> None:
        self.recovery = frozenset(recovery_names)
        self.step = step

    def is_recovery(self, unit_name: str) -> bool:
        return self.all_recovery or unit_name in self.recovery or unit_name in self.always

    def state_dict(self) -> dict:
        return {"recovery": sorted(self.recovery), "step": self.step,
                "all_recovery": self.all_recovery}

    def load_state_dict(self, state: dict) -> None:
        self.recovery = frozenset(state["recovery"])
        self.step = state["step"]
        self.all_recovery = state["all_recovery"]


class PrecisionRuntime:
    """Answers a unit linear's question 'which path this step?' from recipe and plan.

    A unit on the recovery path runs the recovery path in its `recovery_gemms` (all three
    GEMMs by default; `--precision-recovery-gemms wgrad` keeps only the weight-gradient GEMM
    high, like Megatron's `--fp8-wgrad False` for the units it recovers) and the low-cost path
    in the others."""

    def __init__(self, recipe, plan: PrecisionPlan, probes=None, recovery_gemms=GEMM_ROLES):
        self.recipe = recipe
        self.plan = plan
        self.probes = probes  # a ProbeBank when the controller measures the low path
        self.recovered = None if recipe is None else \
            mixed_path(recipe.low, recipe.recovery, frozenset(recovery_gemms))

    def probe_for(self, unit_name: str):
        return self.probes.probe(unit_name) if self.probes is not None else None

    def path_for(self, unit_name: str):
        return self.recovered if self.plan.is_recovery(unit_name) else self.recipe.low
