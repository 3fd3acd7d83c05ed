"""What a unit costs: its GEMMs' multiply-accumulates per step, whole model (all TP shards),
so that a recovery budget can be a share of the FLOPs rather than a count of units.

A unit linear's three GEMMs (fprop, dgrad, wgrad) each cost tokens x K x N; on the recovery
path it spends the share of them in `--precision-recovery-gemms`. With a SwiGLU MLP, fc1
(K = hidden, N = 2 x ffn) costs twice fc2 and several times qkv, so "one unit" is no unit of
cost. A routed expert sees top-k / experts of the tokens on average. A core attention (a unit
with --attention-precision fp8) costs its QK^T and PV GEMMs, as the emulation computes them
(the full square), times 3 for the backward, as a linear's: that is the "linear GEMM FLOPs"
these shares are measured in, plus the core attentions when they are units.
"""

from __future__ import annotations

import numpy as np

from megatron_gnmr.precision.paths import GEMM_ROLES

CORE_ATTENTION = "self_attention.core_attention"  # the unit kind (controller/units.py names it)


def _macs_per_token(config) -> dict[str, float]:
    """fprop MACs per token of each kind of unit (whole model, no TP split)."""
    from megatron_gnmr.model_families import family_of

    m = config.model
    family = family_of(config)
    query_key, value = family.head_widths(config)
    expert = m.moe_ffn_hidden_size or m.ffn_hidden_size
    routed = (m.moe_router_topk / m.num_experts) if m.num_experts else 0.0
    shared = m.moe_shared_expert_intermediate_size or 0
    return {
        **{f"self_attention.{linear.name}": linear.in_features * linear.out_features
           for linear in family.attention_linears(config)},
        CORE_ATTENTION: m.seq_length * m.num_attention_heads * (query_key + value),
        "mlp.linear_fc1": m.hidden_size * 2 * m.ffn_hidden_size,
        "mlp.linear_fc2": m.ffn_hidden_size * m.hidden_size,
        "mlp.shared_experts.linear_fc1": m.hidden_size * 2 * shared,
        "mlp.shared_experts.linear_fc2": shared * m.hidden_size,
        "mlp.experts.linear_fc1": routed * m.hidden_size * 2 * expert,
        "mlp.experts.linear_fc2": routed * expert * m.hidden_size,
    }


def _kind(unit: str) -> str:
    """`layers.3.mlp.experts.5.linear_fc1` -> `mlp.experts.linear_fc1`."""
    return ".".join(part for part in unit.split(".")[2:] if not part.isdigit())


def unit_costs(config, units: list[str]) -> np.ndarray:
    """MACs per optimizer step of each unit's three GEMMs (forward, dgrad, wgrad)."""
    per_token = _macs_per_token(config)
    tokens = config.training.global_batch_size * config.model.seq_length
    return np.array([3.0 * tokens * per_token[_kind(unit)] for unit in units])


class RecoveredShare:
    """The share of the units' GEMM MACs that runs the recovery path in a step, from the
    plan (dynamic choices, static keeps, all-recovery alike)."""

    def __init__(self, config, units: list[str]):
        self.units = units
        self.costs = unit_costs(config, units)
        roles = config.precision.precision_recovery_gemms.split(",")
        linear_share = len(set(roles) & set(GEMM_ROLES)) / len(GEMM_ROLES)
        # A core attention is not a linear: recovered, all of it runs exact.
        self.recovered_part = np.array([
            1.0 if _kind(unit) == CORE_ATTENTION else linear_share for unit in units])
        self.total = float(self.costs.sum())
        self.spent = self.costs * self.recovered_part  # each unit's cost when recovered
        self.index = {unit: i for i, unit in enumerate(units)}

    def budget_costs(self, names: list[str]) -> list[float]:
        """What each of `names` (the controller's eligible units) spends on the recovery
        path, scaled so that all of the model's units together cost len(names): a budget
        rate r of len(names) per step is then r of the units' GEMM FLOPs."""
        return [float(self.spent[self.index[name]] * len(names) / self.total)
                for name in names]

    def of(self, plan) -> float:
        """Once per step: reads the plan's recovered names only, not every unit (DeepSeek-V3
        has 31k units and recovers a few)."""
        if not self.total:
            return 0.0
        if plan.all_recovery:
            return float(self.spent.sum() / self.total)
        recovered = (self.index[name] for name in plan.recovery | plan.always
                     if name in self.index)
        return float(sum(self.spent[i] for i in recovered) / self.total)
