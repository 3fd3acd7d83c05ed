"""The controller's config: `GNMRConfig`, the knobs of the decision rule (SPEC section 5),
and `GNMRRunConfig`, those plus how the controller is wired into a run (the run config's
`gnmr` section, flags `--gnmr-*`). Validated on construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Sequence

from megatron_gnmr.controller.signals import SIGNAL_SETTINGS
from megatron_gnmr.limits import check_limits, limit
from megatron_gnmr.precision.measurements import MEASUREMENTS, in_registry_order, parse_measured

# Every unit of every model family (units are only ever decoder linears and core attentions).
UNITS_DEFAULT = "."
# What the default was before model families (LLaMA's linears spelled out): a checkpoint that
# recorded it selected every unit too (`training/resume_contract.py`).
UNITS_FORMER_DEFAULT = (r"layers\.\d+\.(self_attention\.(linear_(qkv|proj)|core_attention)"
                        r"|mlp\.(experts\.\d+\.|shared_experts\.)?linear_fc[12])$")


def _parse_schedule(value, name: str = "schedule") -> tuple[tuple[int, float], ...]:
    """A threshold schedule: `((step, value), ...)` or the flag form `"1:3.0,500:2.0"`."""
    if value is None or value == "" or value == ():
        return ()
    form = ('"1:3,500:2" or a list of [step, threshold] pairs, e.g. [[1, 3.0], [500, 2.0]]')
    pairs = [item.partition(":")[::2] for item in value.split(",")] \
        if isinstance(value, str) else value
    try:
        if not isinstance(pairs, (list, tuple)) or not all(
                isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in pairs):
            raise TypeError
        return tuple(sorted((int(step), float(threshold)) for step, threshold in pairs))
    except (TypeError, ValueError):
        raise ValueError(f"gnmr.{name} must be {form}, got {value!r}") from None


@dataclass
class GNMRConfig:
    """The GNMR decision rule's parameters (SPEC sections 4 and 5)."""

    alpha: float = 2.0
    """Long-horizon threshold: a unit is risky when GNMR_t = n_t / mean(n_1..n_t-1) > alpha."""
    beta: float = 1.5
    """Short-window threshold: risky when Delta-GNMR (GNMR over its last `delta` values) > beta."""
    delta: int = 8
    """Delta-GNMR window length, in accepted GNMR values (>= 1)."""
    max_o: float = 4
    """Recovery budget: an int (units) or a float in (0, 1) (fraction of units, rounded down)."""
    t_lock: int = 5
    """Steps a selected risky unit stays in the candidate pool after its last exceedance."""
    warmup: int = 16
    """Decision steps during which nothing is risky but non-finite norms (>= delta + 1)."""
    eps: float = 1e-12
    """Guard for zero denominators: x / max(den, eps)."""
    budget_rate: float = 0.0
    """Recovery budget as a share of unit-steps (0: none beyond max_o): a token bucket gains
    budget_rate x units per step (holding at most max_o) and each selected unit spends one,
    so rules compared at one budget_rate spend at most the same unit-steps."""
    budget_in: str = "units"
    """What budget_rate (and max_o's cap on the bucket) is counted in: `units` (each selected
    unit spends one) or `flops` (each spends its GEMM FLOPs on the recovery path, as a share
    of all units': fc1 spends about twice fc2; precision/unit_costs.py)."""
    latch: bool = False
    """A unit once selected stays on the recovery path for the rest of the run (it keeps its
    place within max_o; new selections fill what is left): one rule for every signal, so
    arms compared with a latch hold alike."""
    alpha_schedule: Sequence = field(default=())
    """Optional piecewise-constant schedule for alpha: ((from_step, alpha), ...) or "1:3,500:2"."""
    beta_schedule: Sequence = field(default=())
    """Optional piecewise-constant schedule for beta, same form as alpha_schedule."""

    def __post_init__(self) -> None:
        self.alpha_schedule = _parse_schedule(self.alpha_schedule, "alpha_schedule")
        self.beta_schedule = _parse_schedule(self.beta_schedule, "beta_schedule")
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"gnmr.{name} must be a finite number > 0, got {value!r}")
            for step, threshold in getattr(self, f"{name}_schedule"):
                if step < 1 or not (math.isfinite(threshold) and threshold > 0):
                    raise ValueError(
                        f"gnmr.{name}_schedule needs steps >= 1 and finite thresholds > 0, "
                        f"got ({step}, {threshold})"
                    )
        if isinstance(self.delta, bool) or not isinstance(self.delta, int) or self.delta < 1:
            raise ValueError(f"gnmr.delta must be an integer >= 1, got {self.delta!r}")
        if isinstance(self.t_lock, bool) or not isinstance(self.t_lock, int) or self.t_lock < 0:
            raise ValueError(f"gnmr.t_lock must be an integer >= 0, got {self.t_lock!r}")
        if (
            isinstance(self.warmup, bool)
            or not isinstance(self.warmup, int)
            or self.warmup < self.delta + 1
        ):
            raise ValueError(
                f"gnmr.warmup must be an integer >= delta + 1 = {self.delta + 1}, "
                f"got {self.warmup!r}"
            )
        if not (isinstance(self.eps, (int, float)) and self.eps > 0):
            raise ValueError(f"gnmr.eps must be > 0, got {self.eps!r}")
        if not (isinstance(self.budget_rate, (int, float)) and 0 <= self.budget_rate <= 1):
            raise ValueError(f"gnmr.budget_rate must be in [0, 1], got {self.budget_rate!r}")
        if self.budget_in not in ("units", "flops"):
            raise ValueError(f"gnmr.budget_in must be units or flops, got {self.budget_in!r}")
        self.budget(1)  # validates max_o

    def budget(self, num_units: int) -> int:
        """max_o as a number of units for a model with `num_units` eligible units."""
        max_o = self.max_o
        if isinstance(max_o, bool) or not isinstance(max_o, (int, float)):
            raise ValueError(f"gnmr.max_o must be an int >= 0 or a float in (0, 1), got {max_o!r}")
        if isinstance(max_o, float) and not max_o.is_integer():
            if not 0 < max_o < 1:
                raise ValueError(
                    f"gnmr.max_o as a fraction must lie in (0, 1), got {max_o!r} "
                    "(use an integer for a count of units)"
                )
            return max(0, math.floor(max_o * num_units))
        if max_o < 0:
            raise ValueError(f"gnmr.max_o must be an int >= 0 or a float in (0, 1), got {max_o!r}")
        return int(max_o)

    def threshold(self, name: str, step: int) -> float:
        """alpha_t or beta_t: the last schedule entry at or before `step`, else the constant."""
        value = getattr(self, name)
        for from_step, threshold in getattr(self, f"{name}_schedule"):
            if from_step <= step:
                value = threshold
        return value


# Bases after the rule's: fields come in reverse MRO order, so --help lists the rule's
# knobs, then each signal's (in SIGNALS' order), then the wiring below.
@dataclass
class GNMRRunConfig(*reversed(SIGNAL_SETTINGS), GNMRConfig):
    """The controller: the decision rule's knobs plus how it is wired into training; each
    risk signal's knobs come from its own settings class (controller/signals/)."""

    enabled: bool = False
    """Turn the GNMR controller on (flag: --gnmr)."""
    units: str = UNITS_DEFAULT
    """Regex over unit names selecting the eligible units (default: every unit: the decoder's
    linears, and each layer's core attention where it is switchable: --attention-precision
    fp8 or an attention fault)."""
    nonfinite: str = limit("skip", choices=("skip", "raise"))
    """On a NaN/Inf gradient: `skip` the optimizer step, or `raise` (stop, keep checkpoint)."""
    trace_interval: int = limit(1, ge=0)
    """Write the per-unit trace (norms, scores, decision) every N steps (0: never)."""
    agreement_interval: int = limit(100, ge=0)
    """Every N steps all ranks check they hold the same controller state (0: never)."""
    max_nonfinite_steps: int = limit(10, ge=1)
    """Stop the run after this many consecutive steps with non-finite gradients."""
    signals: str = "gnmr"
    """Risk signals, comma list (a unit's risk is the max of their scores): gnmr, qerr, monitor;
    baselines random, static, oracle (see controller/signals/)."""
    measure: str = ""
    """Measured quantities to trace without a signal acting on them, for replay and calibrate
    (comma list of precision/measurements/: qerr, oracle, loss_cost, loss_cost_gross of the
    linears; attention_error, fp8_underflow, fp8_mse of the core attention)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_limits(self, "gnmr")
        from megatron_gnmr.controller.signals import observed_by, parse_signals

        unknown = set(observed_by(parse_signals(self.signals))) - {"alarmed", *MEASUREMENTS}
        if unknown:
            raise ValueError(f"gnmr.signals read {', '.join(sorted(unknown))}, which no "
                             f"measurement measures (precision/measurements/: "
                             f"{', '.join(MEASUREMENTS)})")
        parse_measured(self.measure)
        for settings in SIGNAL_SETTINGS:
            if hasattr(settings, "check"):
                settings.check(self)

    def probed(self) -> tuple[str, ...]:
        """The measured quantities this run needs (to act on or to trace), in the probe
        bank's slot order."""
        from megatron_gnmr.controller.signals import observed_by, parse_signals

        return in_registry_order(
            {name for name in observed_by(parse_signals(self.signals)) if name in MEASUREMENTS}
            | set(parse_measured(self.measure)))

    def signal_settings(self, run_seed: int) -> dict:
        """What the risk signals read (recorded in the trace header, so replay scores them
        the same way, and swept by replay)."""
        knobs = {f.name: getattr(self, f.name)
                 for settings in SIGNAL_SETTINGS for f in dataclasses.fields(settings)}
        return {"signals": self.signals, **knobs, "run_seed": run_seed}

    def policy_config(self) -> GNMRConfig:
        names = [f.name for f in dataclasses.fields(GNMRConfig)]
        return GNMRConfig(**{name: getattr(self, name) for name in names})
