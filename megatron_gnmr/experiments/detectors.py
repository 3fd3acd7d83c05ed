"""The detectors the detection study compares, each a family of settings of the controller
(a risk signal and its knobs, the policy's warm-up, lock and max_o) swept over one threshold,
and what a detector does on one trace: its first alarm, replayed through the live policy
(`controller/replay.py`), so the alarm computed here is the first recovery a live run with the
same settings would make (a test holds them equal).

Families (`FAMILIES`), all acting per core attention unless said:
- delta-size: the low path's delta error as a share of the score gradient (`attention_error`,
  issue 45's early detector), each step's value (window 1) or the median of 50;
- delta-sign: Page's CUSUM on the sign agreement of the delta error over the step's rows
  (`attention_bias`); rounding-sign: the same on O's own rounding (`rounding_bias`);
- te-unit / te-global: Transformer Engine's AutoswitchGemm rule (an FP8 operand's underflow
  share or quantization MSE above its threshold, both swept), per unit and with the pull
  request's global scope;
- spectral: the attention monitor's alarm (the trend model on the dW_q/dW_k update spectra, as
  the run raised it live: one setting);
- gnmr: GNMR's own exceedances (alpha, with beta = 3/4 alpha).

The fault ladder's families (`LADDER_FAMILIES`, issue 56) all run under one rule (`FAIR`: at
most 2 units, no bucket, the policy's latch, no signal-level hold), except the TE rule also
without the latch (as its pull request runs); they read only the kernel probe, TE's metrics
(with and without O) and the gradient norms. `oracle-rounding-sign`, section 13's signal,
re-applies the fault's rounding: it is replayed for comparison and never chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gnmr.controller.config import GNMRConfig
from megatron_gnmr.controller.replay import Decisions
from megatron_gnmr.controller.trace import Trace

EVERY_UNIT = "every unit"  # a family's max_o that grows with the model: all its units at once

# What every per-unit detector runs with: it acts from the step after its first alarm and
# keeps what it recovered (hold -1, where the signal holds), no lock beyond its own hold.
PER_UNIT = {"max_o": 2, "t_lock": 0, "delta": 1, "warmup": 2}


# TE's rule has two thresholds, swept together: (underflow %, MSE). Its defaults (5, 1e-4)
# and its example config's MSE (0.1) are on the grid.
TE_THRESHOLDS = ("autoswitch_underflow_pct", "autoswitch_mse")
TE_GRID = tuple((underflow, mse) for underflow in (5.0, 10.0, 20.0, 40.0, 100.0)
                for mse in (1e-4, 1e-3, 1e-2, 0.1, 1.0))


@dataclass(frozen=True)
class Family:
    name: str
    signals: str
    knob: str | tuple | None  # the swept setting (a signal's, several, or the policy's alpha)
    grid: tuple
    fixed: dict = field(default_factory=dict)  # other signal settings
    policy: dict = field(default_factory=lambda: dict(PER_UNIT))
    text: str = ""


FAMILIES = (
    Family("delta-size", "attention_error", "attention_error_threshold",
           (0.04, 0.05, 0.06, 0.07, 0.08, 0.1, 0.12, 0.15, 0.2, 0.3, 0.45, 0.6),
           {"attention_error_window": 1, "attention_error_hold": -1},
           text="delta error share of the score gradient, each step"),
    Family("delta-size-median50", "attention_error", "attention_error_threshold",
           (0.04, 0.05, 0.06, 0.07, 0.08, 0.1, 0.12, 0.15, 0.2, 0.3, 0.45, 0.6),
           {"attention_error_window": 50, "attention_error_hold": -1},
           {**PER_UNIT, "warmup": 50}, "its median over 50 steps, from step 50"),
    Family("delta-sign", "attention_bias", "attention_bias_threshold",
           (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0),
           {"attention_bias_drift": 0.05, "attention_bias_hold": -1},
           text="CUSUM on the delta error's sign agreement (drift 0.05)"),
    Family("rounding-sign", "rounding_bias", "attention_bias_threshold",
           (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0),
           {"attention_bias_drift": 0.05, "attention_bias_hold": -1},
           text="CUSUM on the sign agreement of O's rounding (drift 0.05)"),
    Family("te-unit", "autoswitch", TE_THRESHOLDS, TE_GRID, {"autoswitch_scope": "unit"},
           text="TE AutoswitchGemm: underflow % or MSE above its threshold, per unit"),
    Family("te-global", "autoswitch", TE_THRESHOLDS, TE_GRID, {"autoswitch_scope": "global"},
           {**PER_UNIT, "max_o": EVERY_UNIT}, "the same, TE's global scope (every unit)"),
    Family("spectral", "monitor", None, (None,), {"monitor_hold": -1},
           text="the attention monitor's spectral alarm, as raised live"),
    Family("gnmr", "gnmr", "alpha", (1.5, 2.0, 3.0, 5.0, 10.0, 20.0), {},
           {"max_o": 2, "t_lock": 5, "delta": 8, "warmup": 16},
           "GNMR exceedances (beta = 3/4 alpha)"),
)
# Issue 56: every arm under one rule (at most 2 units, no bucket, the policy's latch).
FAIR = {"max_o": 2, "t_lock": 0, "delta": 1, "warmup": 2, "latch": True}
UNLATCHED = {**FAIR, "latch": False}
SIGN_GRID = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
SIZE_GRID = (0.025, 0.03, 0.035, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3)
SIGN_FIXED = {"attention_bias_drift": 0.05, "attention_bias_hold": 0}
ORACLE = "oracle-rounding-sign"

LADDER_FAMILIES = (
    Family("probe-output-sign", "kernel_output_bias", "attention_bias_threshold", SIGN_GRID,
           SIGN_FIXED, FAIR, "CUSUM on the sign agreement of O's error, kernel probe"),
    Family("probe-delta-sign", "kernel_delta_bias", "attention_bias_threshold", SIGN_GRID,
           SIGN_FIXED, FAIR, "CUSUM on the sign agreement of delta's error, kernel probe"),
    Family("probe-delta-size", "kernel_delta_error", "attention_error_threshold", SIZE_GRID,
           {"attention_error_window": 1, "attention_error_hold": 0}, FAIR,
           "delta's relative error, kernel probe, each step"),
    Family("probe-delta-size-median50", "kernel_delta_error", "attention_error_threshold",
           SIZE_GRID, {"attention_error_window": 50, "attention_error_hold": 0},
           {**FAIR, "warmup": 50}, "its median over 50 steps, from step 50"),
    Family("te-unit-latch", "autoswitch", TE_THRESHOLDS, TE_GRID, {"autoswitch_scope": "unit"},
           FAIR, "TE AutoswitchGemm per unit, with the latch"),
    Family("te-unit-nolatch", "autoswitch", TE_THRESHOLDS, TE_GRID,
           {"autoswitch_scope": "unit"}, UNLATCHED, "the same without a latch (its PR)"),
    Family("te-o-latch", "autoswitch_o", TE_THRESHOLDS, TE_GRID, {"autoswitch_scope": "unit"},
           FAIR, "TE's rule allowed to see O too, with the latch"),
    Family("te-o-nolatch", "autoswitch_o", TE_THRESHOLDS, TE_GRID,
           {"autoswitch_scope": "unit"}, UNLATCHED, "the same without a latch"),
    Family("gnmr-latch", "gnmr", "alpha", (1.5, 2.0, 3.0, 5.0, 10.0, 20.0), {},
           {"max_o": 2, "t_lock": 5, "delta": 8, "warmup": 16, "latch": True},
           "GNMR exceedances (beta = 3/4 alpha), with the latch"),
    Family(ORACLE, "rounding_bias", "attention_bias_threshold", SIGN_GRID, SIGN_FIXED, FAIR,
           "section 13's signal: re-applies the fault's rounding (an oracle, never chosen)"),
)
FAMILY = {family.name: family for family in (*FAMILIES, *LADDER_FAMILIES)}


@dataclass(frozen=True)
class Setting:
    """One point of a family: its settings as the controller takes them."""

    family: str
    value: object  # the swept knob's value (None: the family has one setting)

    @property
    def label(self) -> str:
        if self.value is None:
            return self.family
        if isinstance(self.value, tuple):
            return f"{self.family} {'/'.join(f'{v:g}' for v in self.value)}"
        return f"{self.family} {self.value:g}"

    def controller(self, units: int) -> tuple[GNMRConfig, dict]:
        """(policy config, signal settings) for a model of `units` core attentions."""
        family = FAMILY[self.family]
        policy = dict(family.policy)
        if policy["max_o"] == EVERY_UNIT:
            policy["max_o"] = units
        signal = {"signals": family.signals, **family.fixed}
        if family.knob == "alpha":
            policy.update(alpha=self.value, beta=0.75 * self.value)
        elif isinstance(family.knob, tuple):
            signal.update(zip(family.knob, self.value))
        elif family.knob is not None:
            signal[family.knob] = self.value
        return GNMRConfig(**policy), signal


def settings(families=None, among=FAMILIES) -> list[Setting]:
    """Every setting of the families `among` (named in `families`, or all of them)."""
    return [Setting(f.name, value) for f in among if families is None or f.name in families
            for value in f.grid]


@dataclass(frozen=True)
class Alarm:
    step: int  # the decision's step: the recovery acts from step + 1
    units: tuple[int, ...]


def spend(trace: Trace, setting: Setting) -> float:
    """The share of the core attentions' unit-steps the detector would run exact over the
    trace (the decision of step s runs in step s + 1): exact up to its first action, after it
    an estimate (the trace is the twin's, not the controlled run's)."""
    config, signal = setting.controller(len(trace.units))
    recovered = sum(len(d.recovery) for d in list(Decisions(trace, config, signal))[:-1])
    return recovered / (len(trace.steps) * len(trace.units))


def first_alarm(trace: Trace, setting: Setting) -> Alarm | None:
    """The first decision with a recovery, or None if the detector never acts on the trace."""
    config, signal = setting.controller(len(trace.units))
    for step, decision in zip(trace.steps, Decisions(trace, config, signal)):
        if decision.recovery:
            return Alarm(step, tuple(decision.recovery))
    return None
