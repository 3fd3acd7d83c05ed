"""The controller inside a training run: statistics -> policy -> next step's plan.

`Controller.observe` is called once per optimizer step, after the gradients are reduced and
before the optimizer step. It owns the one all-reduce of the statistics (`GradStats`), the
pure policy, the `PrecisionPlan` the precision backends read, and the trace.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from megatron_gnmr.config import GNMRRunConfig
from megatron_gnmr.controller.grad_stats import GradStats, StepGradStats
from megatron_gnmr.controller.policy import Decision, GNMRPolicy
from megatron_gnmr.controller.trace import TraceWriter
from megatron_gnmr.controller.units import UnitRegistry
from megatron_gnmr.precision.plan import PrecisionPlan


class Controller:
    def __init__(self, config: GNMRRunConfig, registry: UnitRegistry,
                 model_chunks: list[torch.nn.Module], group=None):
        self.config = config
        self.registry = registry
        self.grad_stats = GradStats(registry, model_chunks, group)
        self.policy = GNMRPolicy(config.policy_config(), registry.num_units)
        self.plan = PrecisionPlan(registry.names)
        self.trace: TraceWriter | None = None

    def open_trace(self, run_dir: str, resume_step: int) -> None:
        self.trace = TraceWriter(Path(run_dir) / "gnmr_trace.jsonl", self.registry.names,
                                 self.config.policy_config(), resume_step)

    def observe(self, stats: StepGradStats, step: int) -> Decision:
        """Decide the recovery set for step `step + 1` from step `step`'s statistics."""
        decision = self.policy.step(stats.unit_norms)
        self.plan.advance(decision.recovery, step + 1)
        interval = self.config.trace_interval
        if self.trace is not None and interval and step % interval == 0:
            self.trace.write(decision)
        return decision

    def metrics(self, decision: Decision) -> dict:
        summary = self.policy.summary()
        finite_gnmr = decision.gnmr[np.isfinite(decision.gnmr)]
        return {
            "gnmr/recovery_size": len(decision.recovery),
            "gnmr/pool_size": decision.pool_size,
            "gnmr/risky_units": int(decision.risky.sum()),
            "gnmr/recovery_sparsity": summary["recovery_sparsity"],
            "gnmr/exceedance_rate": summary["exceedance_rate"],
            "gnmr/switches_per_1k_steps": summary["switches_per_1k_steps"],
            "gnmr/max_gnmr": float(finite_gnmr.max()) if finite_gnmr.size else float("nan"),
            "gnmr/recovery": [self.registry.names[u] for u in decision.recovery],
        }

    def state_dict(self) -> dict:
        return {"policy": self.policy.state_dict(), "plan": self.plan.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state["policy"])
        self.plan.load_state_dict(state["plan"])

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
