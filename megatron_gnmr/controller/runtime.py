"""The controller inside a training run: statistics -> policy -> next step's plan.

The trainer calls it twice per optimizer step: `after_backward`, after the gradients are
reduced and before the update (statistics, clipping: `outcome.StepOutcome`), and `decide`,
after the update and the monitors' check (the plan of the next step, from the statistics and
the alarms of this one). It owns the one
all-reduce of the statistics (`GradStats`: norms and, when signals need them, the precision
probes' sums), the other risk signals (`signals/`), the pure policy, the
`PrecisionPlan` the precision backends read, clipping with the same global norm, and the
trace.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from pathlib import Path

import numpy as np
import torch

from megatron_gnmr.controller.config import GNMRRunConfig
from megatron_gnmr.controller.grad_stats import GradStats, StepGradStats
from megatron_gnmr.controller.outcome import StepOutcome
from megatron_gnmr.controller.policy import Decision, GNMRPolicy
from megatron_gnmr.controller.signals import (
    Observations,
    build_signals,
    combined,
    observed_by,
    parse_signals,
)
from megatron_gnmr.controller.trace import TraceWriter
from megatron_gnmr.controller.units import UnitRegistry
from megatron_gnmr.errors import RunAborted
from megatron_gnmr.platform.device import run_device
from megatron_gnmr.precision.plan import PrecisionPlan
from megatron_gnmr.precision.measurements import values


RECENT_STEPS = 500


class ControllerDisagreement(RunAborted):
    pass


class Controller:
    def __init__(self, config: GNMRRunConfig, registry: UnitRegistry,
                 model_chunks: list[torch.nn.Module], plan: PrecisionPlan, group=None,
                 expert_parallel: bool = False, probes=None, seed: int = 0,
                 clip_grad: float = 0.0, faults=None, sharded_gradients: bool = False,
                 attention_sums=None, unit_costs=None):
        self.config = config
        self.clip_grad = clip_grad
        self.faults = faults  # test-only hooks (training.faults.FaultHooks), or None
        self.registry = registry
        self.grad_stats = GradStats(registry, model_chunks, group, expert_parallel, probes,
                                    sharded=sharded_gradients, attention_sums=attention_sums)
        self.stats: StepGradStats | None = None  # this step's, between the two calls
        self.unit_costs = unit_costs  # what each unit spends of a budget in FLOPs
        self.policy = GNMRPolicy(config.policy_config(), registry.num_units, unit_costs)
        self.signal_names = parse_signals(config.signals)
        self.signal_settings = config.signal_settings(seed)
        self.signals = build_signals(self.signal_names, registry.names, self.signal_settings)
        self.probed = config.probed()  # fixed for the run: not re-parsed every step
        self.traces_alarms = "alarmed" in observed_by(self.signal_names)
        self.alarmed: frozenset[str] = frozenset()  # the alarms of the last decision
        self.plan = plan
        self.trace: TraceWriter | None = None
        # The last steps' scores and decisions, for the images logged during training
        # (re-reading the whole trace would grow with the run).
        self.recent: deque = deque(maxlen=RECENT_STEPS)

    def open_trace(self, run_dir: str, resume_step: int) -> None:
        self.trace = TraceWriter(Path(run_dir) / "gnmr_trace.jsonl", self.registry.names,
                                 self.config.policy_config(), resume_step, self.signal_settings,
                                 self.unit_costs, self.probed)

    @property
    def unit_names(self) -> list[str]:
        return self.registry.names

    def after_backward(self, step: int, optimizer, loss: float) -> StepOutcome:
        """Step `step`'s statistics (the one all-reduce), then clipping and megatron's
        gradient preparation unless something is non-finite."""
        stats = self.stats = self.grad_stats.compute(float(optimizer.get_loss_scale()),
                                                     optimizer)
        nonfinite = [self.registry.names[u] for u in np.flatnonzero(~np.isfinite(
            stats.unit_norms))]
        if not math.isfinite(stats.total_norm) and not nonfinite:
            nonfinite.append("non-unit")
        if not math.isfinite(loss):
            nonfinite.append("loss")
        if nonfinite:
            return StepOutcome(stats.total_norm, False, tuple(nonfinite))
        self.grad_stats.clip_(stats.total_norm, self.clip_grad)
        found_inf = optimizer.prepare_grads()
        return StepOutcome(stats.total_norm, not found_inf, ())

    def decide(self, step: int, alarmed: frozenset[str]) -> dict:
        """Step `step`'s statistics -> the plan of step `step + 1`, after the update and the
        monitors' check of step `step`, so an alarm raised at that check already acts on the
        next step. `alarmed`: the unit-name prefixes under a firing monitor alarm, for the
        `monitor` signal. Returns the step's metrics."""
        decision = self.observe(self.stats, step, alarmed)
        if self.faults is not None:
            self.faults.corrupt_controller(step, self.policy)
        interval = self.config.agreement_interval
        if interval and step % interval == 0:
            self.verify_agreement(step)
        return self.metrics(decision)

    def observe(self, stats: StepGradStats, step: int,
                alarmed: frozenset[str] = frozenset()) -> Decision:
        """Decide the recovery set for step `step + 1` from step `step`'s statistics."""
        measured = values(self.probed, stats.probe_sums) if stats.probe_sums is not None else {}
        self.alarmed = frozenset(alarmed)
        observations = Observations(measured, self.alarmed)
        decision = self.policy.step(stats.unit_norms,
                                    combined([s.scores(observations) for s in self.signals]),
                                    use_gnmr="gnmr" in self.signal_names)
        self.plan.advance([self.registry.names[u] for u in decision.recovery], step + 1)
        self.recent.append((step, decision.gnmr.copy(), decision.recovery))
        interval = self.config.trace_interval
        if self.trace is not None and interval and step % interval == 0:
            traced = dict(measured)
            if self.traces_alarms:
                traced["alarmed"] = sorted(self.alarmed)
            self.trace.write(decision, traced)
        return decision

    def verify_agreement(self, step: int) -> None:
        """All ranks must hold the same controller state: a digest all-reduced as MIN and
        MAX (one collective, every `agreement_interval` steps). On a mismatch the digests
        are gathered so the error can name the ranks."""
        digest = self._digest()
        both = torch.tensor([digest, -digest], dtype=torch.int64, device=run_device())
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX)
        if int(both[0]) == -int(both[1]):
            return
        digests = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(digests, digest)
        groups: dict[int, list[int]] = {}
        for rank, value in enumerate(digests):
            groups.setdefault(value, []).append(rank)
        raise ControllerDisagreement(
            f"step {step}: ranks disagree on the controller state: "
            + " vs ".join(f"ranks {ranks}" for ranks in groups.values())
        )

    def _digest(self) -> int:
        """A hash of ALL controller state: policy histories and locks, the plan, the other
        signals' state (qerr history, the random baseline's generator), firing alarms."""
        sha = hashlib.sha256()
        _hash_into(sha, self.state_dict())
        return int.from_bytes(sha.digest()[:8], "little") >> 2  # fits int64 with room to negate

    def summary(self) -> dict:
        return {f"gnmr/{key}": value for key, value in self.policy.summary().items()}

    def recent_window(self) -> dict | None:
        """The last steps as plain arrays, for the images logged during training: `gnmr`
        [steps, units], `recovery` [steps, units] (shown in the step it runs), the unit
        names, the first step and alpha."""
        if not self.recent:
            return None
        steps = [step for step, _, _ in self.recent]
        gnmr = np.array([scores for _, scores, _ in self.recent])
        recovery = np.zeros_like(gnmr, dtype=bool)
        for row, (_, _, decided) in enumerate(list(self.recent)[:-1]):
            recovery[row + 1, list(decided)] = True
        return {"units": self.registry.names, "gnmr": gnmr, "recovery": recovery,
                "first_step": steps[0], "alpha": self.config.threshold("alpha", steps[-1])}

    def metrics(self, decision: Decision) -> dict:
        summary = self.policy.summary()
        finite_gnmr = decision.gnmr[np.isfinite(decision.gnmr)]
        return {
            "gnmr/recovery_size": len(decision.recovery),
            "gnmr/pool_size": decision.pool_size,
            "gnmr/risky_units": int(decision.risky.sum()),
            "gnmr/recovery_sparsity": summary["recovery_sparsity"],
            "gnmr/recovery_cost_share": summary["recovery_cost_share"],
            "gnmr/exceedance_rate": summary["exceedance_rate"],
            "gnmr/switches_per_1k_steps": summary["switches_per_1k_steps"],
            "gnmr/max_gnmr": float(finite_gnmr.max()) if finite_gnmr.size else float("nan"),
            "gnmr/recovery": [self.registry.names[u] for u in decision.recovery],
        }

    def state_dict(self) -> dict:
        return {"policy": self.policy.state_dict(), "plan": self.plan.state_dict(),
                "signals": {signal.name: signal.state_dict() for signal in self.signals},
                "alarmed": sorted(self.alarmed)}

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state["policy"])
        self.plan.load_state_dict(state["plan"])
        for signal in self.signals:
            signal.load_state_dict(state["signals"][signal.name])
        self.alarmed = frozenset(state["alarmed"])

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()


def _hash_into(sha, value) -> None:
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            sha.update(str(key).encode())
            _hash_into(sha, value[key])
    elif isinstance(value, (list, tuple)):
        sha.update(b"[")
        for item in value:
            _hash_into(sha, item)
        sha.update(b"]")
    elif isinstance(value, np.ndarray):
        sha.update(f"{value.dtype}{value.shape}".encode())
        sha.update(np.ascontiguousarray(value).tobytes())
    else:
        sha.update(repr(value).encode())
