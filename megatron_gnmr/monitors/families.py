"""The mechanism monitor families (SPEC 7): the registry.

A family is a monitor class (built from the model chunks, the monitor config and the model
family, `model_families/`, with
`before_step`, `measure`, `after_step` and a `state_dict`), the signals of it that raise alarms
with the side on which each fails, and the units an alarm of layer l names (for the
controller's `monitor` risk signal). Adding a family is one file (its monitor) and one entry
here; `--monitors` accepts every name below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Family:
    monitor: Callable  # (model_chunks, MonitorConfig, ModelFamily) -> monitor
    alarm_signals: dict[str, int]
    """Signals that raise alarms -> the side they fail on: -1 falling, +1 rising."""
    unit_prefixes: Callable[[int], tuple[str, ...]]
    """The units a firing alarm of layer l names, as unit-name prefixes in order of
    preference: the first that some unit of the model has is named."""
    needs_experts: bool = False
    charts: dict[str, str] = field(default_factory=dict)
    """Dashboard charts: title -> a regex over the signal names it logs per layer (every
    layer on one chart); together they cover every signal the family logs."""


def _attention(model_chunks, config, model_family):
    from megatron_gnmr.monitors.attention import AttentionMonitor

    return AttentionMonitor(model_chunks, config, model_family)


def _router(model_chunks, config, model_family):
    from megatron_gnmr.monitors.router import RouterMonitor

    return RouterMonitor(model_chunks, config)


FAMILIES = {
    # Update spectra collapse: their entropies fall (SPEC 7.1). The mechanism (biased
    # rounding in the attention backward) lives in the core attention, so an alarm names the
    # layer's core attention where it is a unit: its projections' GEMMs cannot cause it, and
    # recovering them would spend the budget on units that change nothing. Where the core
    # attention is not switchable, the alarm names the layer's attention linears.
    "attention": Family(_attention, {"H_D2_mean": -1, "H_dWq": -1, "H_dWk": -1},
                        lambda layer: (f"layers.{layer}.self_attention.core_attention",
                                       f"layers.{layer}.self_attention."),
                        charts={"H(D2), QK-product increment": r"H_D2_(mean|min)",
                                "H(dW_q), H(dW_k)": r"H_dW[qk]",
                                "normalised entropies": r"H_\w+_normalized",
                                "effective rank": r"effective_rank_\w+"}),
    # Routing collapses: entropy falls, router rows align, load concentrates (SPEC 7.2).
    # A balancing bias that runs away (DeepSeek routers) is balancing losing to the router.
    "router": Family(_router, {"entropy_mean": -1, "weight_similarity": +1,
                               "load_max_over_mean": +1, "expert_bias_spread": +1},
                     lambda layer: (f"layers.{layer}.mlp.",), needs_experts=True,
                     charts={"routing entropy": r"(gate_)?entropy_\w+",
                             "router rows, balancing bias": r"weight_similarity|"
                             r"conditioning_ratio|expert_bias_spread",
                             "expert load": r"load_\w+"}),
}


def parse_families(text: str) -> list[str]:
    """`--monitors a,b` -> the families in registry order (the order they measure in)."""
    names = set(filter(None, text.split(",")))
    unknown = names - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown monitor(s) {', '.join(sorted(unknown))}; use "
                         f"{', '.join(FAMILIES)}")
    return [name for name in FAMILIES if name in names]


def failure_direction(signal: str) -> int:
    """The side on which a monitored signal fails (0: either), across every family; the
    training loss (used by the reference band in the alarm comparisons) fails rising."""
    if signal == "train_loss":
        return +1
    for family in FAMILIES.values():
        if signal in family.alarm_signals:
            return family.alarm_signals[signal]
    return 0
