"""Risk signals besides GNMR, and the budget-matched baselines: the registry.

Every signal turns one step's observations into a dimensionless score per unit, > 1 meaning
"risky"; the policy takes a unit's risk as the MAX of the scores of the signals in
`--gnmr-signals` (any one signal can make a unit risky; among risky units the most alarming
score ranks first) and keeps SPEC 5's pool, lock and budget. The max is chosen because the
signals do not share a scale beyond their thresholds: a sum or product would let a signal
that is merely high everywhere (qerr on heavy-tailed inputs) drown the other's spikes.

`gnmr` itself is scored inside the policy (SPEC 4). Adding a signal is one file (a
`base.RiskSignal` subclass, with its knobs as its `settings_class`) and one line in `SIGNALS`;
docs/architecture.md walks through it.
Baselines always have more candidates than budget, so they are meant to run with
`--gnmr-budget-rate` (the token bucket in the policy) to spend the same unit-steps as the
rule they are compared with.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megatron_gnmr.controller.signals.attention_bias import (
    AttentionBiasSignal,
    KernelDeltaBiasSignal,
    KernelOutputBiasSignal,
    RoundingBiasSignal,
)
from megatron_gnmr.controller.signals.attention_error import (
    AttentionErrorSignal,
    KernelDeltaErrorSignal,
)
from megatron_gnmr.controller.signals.autoswitch import (
    AutoswitchSignal,
    AutoswitchWithOutputSignal,
)
from megatron_gnmr.controller.signals.base import Observations, RiskSignal
from megatron_gnmr.controller.signals.monitor import MonitorSignal
from megatron_gnmr.controller.signals.oracle import OracleSignal
from megatron_gnmr.controller.signals.qerr import QerrSignal
from megatron_gnmr.controller.signals.random_units import RandomSignal
from megatron_gnmr.controller.signals.static_units import StaticSignal

SIGNALS: dict[str, type[RiskSignal] | None] = {
    "gnmr": None,  # SPEC 4-5, inside controller/policy.py
    "qerr": QerrSignal,
    "monitor": MonitorSignal,
    "random": RandomSignal,
    "static": StaticSignal,
    "oracle": OracleSignal,
    "autoswitch": AutoswitchSignal,
    "attention_error": AttentionErrorSignal,
    "attention_bias": AttentionBiasSignal,
    "rounding_bias": RoundingBiasSignal,
    "autoswitch_o": AutoswitchWithOutputSignal,
    "kernel_output_bias": KernelOutputBiasSignal,
    "kernel_delta_bias": KernelDeltaBiasSignal,
    "kernel_delta_error": KernelDeltaErrorSignal,
}

# The gnmr section's fields that belong to a signal (controller/config.py composes them).
SIGNAL_SETTINGS = tuple(dict.fromkeys(
    signal.settings_class for signal in SIGNALS.values()
    if signal is not None and signal.settings_class is not None))

__all__ = ["SIGNALS", "SIGNAL_SETTINGS", "Observations", "RiskSignal", "build_signals",
           "combined", "observed_by", "parse_signals", "settings_of"]


def parse_signals(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [n for n in names if n not in SIGNALS]
    if unknown or not names:
        bad = ", ".join(unknown) if unknown else repr(text)
        raise ValueError(f"gnmr.signals has unknown or no entries ({bad}); use a comma list "
                         f"of {', '.join(SIGNALS)}")
    return names


def build_signals(names: tuple[str, ...], unit_names: list[str],
                  settings: dict) -> list[RiskSignal]:
    """The run's signals other than GNMR, in the order given. Each reads its knobs' defaults
    where the settings lack them: a trace recorded before a knob existed, or a signal
    registered after the gnmr section was composed (a plugin, a test: no flags)."""
    return [SIGNALS[name](unit_names, {**_defaults(SIGNALS[name]), **settings})
            for name in names if SIGNALS[name] is not None]


def _defaults(signal: type[RiskSignal]) -> dict:
    fields = dataclasses.fields(signal.settings_class) if signal.settings_class else ()
    return {f.name: f.default for f in fields}


def observed_by(names: tuple[str, ...]) -> tuple[str, ...]:
    """The observations the named signals read."""
    wanted = {field for name in names if SIGNALS[name] for field in SIGNALS[name].observes}
    return tuple(sorted(wanted))


def combined(scores: list[np.ndarray]) -> np.ndarray | None:
    """The max over the run's non-GNMR signals (None when it has none)."""
    return np.max(np.stack(scores), axis=0) if scores else None


def settings_of(names: tuple[str, ...]) -> tuple[str, ...]:
    """The names of the knobs the named signals read (their settings classes' fields)."""
    return tuple(f.name for name in names if SIGNALS[name] and SIGNALS[name].settings_class
                 for f in dataclasses.fields(SIGNALS[name].settings_class))
