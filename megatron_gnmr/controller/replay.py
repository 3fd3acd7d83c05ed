"""`megatron-gnmr replay`: re-run the policy offline on a recorded trace.

Each `--gnmr-*` flag takes one or more values; the sweep is their cartesian product, with
every flag not given taken from the config recorded in the trace. Given the live run's own
settings, the replay must make exactly the live run's decisions (it is checked and said).

Signals are replayed from what the trace recorded (norms; the measured quantities, e.g. qerr
and the oracle's true weight-gradient errors, when the run measured them, `--gnmr-measure
qerr,oracle`; each signal reads them by name as it did live), so one
recorded run compares selection rules (`--gnmr-signals gnmr qerr random oracle`) at one
budget (`--gnmr-budget-rate`). With oracle errors recorded each rule is also scored by the
damage it catches: "oracle capture" = the true error of the units it recovers, summed over
steps, over the most any choice of the same number of units could catch (the oracle's).
The counterfactual is approximate in one way: the recorded errors are those of the live
run's trajectory, not of the trajectory the replayed rule would have produced.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import typing
from collections import Counter

import numpy as np
from tqdm import tqdm

from megatron_gnmr.controller.config import GNMRConfig
from megatron_gnmr.controller.policy import GNMRPolicy
from megatron_gnmr.controller.signals import (
    SIGNAL_SETTINGS,
    Observations,
    build_signals,
    combined,
    observed_by,
    parse_signals,
    settings_of,
)
from megatron_gnmr.controller.trace import Trace, iter_gaps, read_trace
from megatron_gnmr.errors import UserError
from megatron_gnmr.precision.measurements import MEASUREMENTS

SWEEPABLE = {"alpha": float, "beta": float, "delta": int, "max_o": None, "t_lock": int,
             "warmup": int, "budget_rate": float, "budget_in": str}
# `signals` and every signal's own knobs (their settings classes' fields).
SIGNAL_SWEEPABLE = {"signals": str, **{
    f.name: typing.get_type_hints(settings)[f.name]
    for settings in SIGNAL_SETTINGS for f in dataclasses.fields(settings)}}


def _number(text: str):
    try:
        return int(text)
    except ValueError:
        return float(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="gnmr_trace.jsonl of a run")
    for name, kind in SWEEPABLE.items():
        parser.add_argument(f"--gnmr-{name.replace('_', '-')}", dest=name, nargs="+",
                            type=kind or _number, metavar="V",
                            help=f"one or more values of {name} (default: the recorded one)")
    for name, kind in SIGNAL_SWEEPABLE.items():
        parser.add_argument(f"--gnmr-{name.replace('_', '-')}", dest=name, nargs="+",
                            type=kind, metavar="V",
                            help=f"one or more values of {name} (default: the recorded one)")
    parser.add_argument("--top", type=int, default=5, help="most-recovered units to list")


@dataclasses.dataclass
class ReplayResult:
    config: GNMRConfig
    summary: dict
    most_recovered: list[tuple[str, int]]
    decisions: list[tuple[int, ...]]
    matches_recorded: int  # steps whose decision equals the recorded one
    signal_settings: dict = dataclasses.field(default_factory=dict)
    oracle_capture: float | None = None
    """Caught true weight-gradient error over the most the same unit-steps could catch."""


def _signals(trace: Trace, settings: dict):
    names = parse_signals(settings["signals"])
    needed = observed_by(names)
    missing = [o for o in needed if (o in MEASUREMENTS and o not in trace.measured)
               or (o == "alarmed" and trace.alarmed is None)]
    if missing:
        measure = ",".join(o for o in missing if o in MEASUREMENTS)
        how = f"--gnmr-measure {measure}" if measure else "the monitor signal"
        raise UserError(f"replay: the trace has no recorded {', '.join(missing)} values (record "
                        f"them live with {how})")
    return names, build_signals(names, trace.units, settings)


class Decisions:
    """The policy's decision at each recorded step, as a live run with these settings would
    have made it, one per iteration (a caller that needs only the first action stops there)."""

    def __init__(self, trace: Trace, config: GNMRConfig, signal_settings: dict | None = None,
                 show_progress: bool = False):
        self.trace, self.show_progress = trace, show_progress
        self.settings = {**trace.signal_settings, **(signal_settings or {})}
        names, self.signals = _signals(trace, self.settings)
        self.use_gnmr = "gnmr" in names
        if config.budget_in == "flops" and trace.unit_costs is None:
            raise UserError("replay: a budget in flops needs the units' costs, which this trace "
                            "does not record (recorded by runs of this version)")
        self.policy = GNMRPolicy(config, len(trace.units), trace.unit_costs)

    def __iter__(self):
        trace = self.trace
        for i in tqdm(range(len(trace.steps)), desc="replay", unit="step",
                      disable=not self.show_progress, leave=False):
            observations = Observations(
                {name: values[i] for name, values in trace.measured.items()},
                trace.alarmed[i] if trace.alarmed is not None else frozenset())
            yield self.policy.step(trace.norms[i],
                                   combined([s.scores(observations) for s in self.signals]),
                                   use_gnmr=self.use_gnmr)


def replay(trace: Trace, config: GNMRConfig, show_progress: bool = False,
           signal_settings: dict | None = None) -> ReplayResult:
    steps = Decisions(trace, config, signal_settings, show_progress)
    counts: Counter[int] = Counter()
    decisions = []
    for decision in steps:
        counts.update(decision.recovery)
        decisions.append(decision.recovery)
    matches = sum(a == b for a, b in zip(decisions, trace.recovery))
    return ReplayResult(config, steps.policy.summary(),
                        [(trace.units[u], c) for u, c in counts.most_common()],
                        decisions, matches, steps.settings, oracle_capture(trace, decisions))


def oracle_capture(trace: Trace, decisions: list[tuple[int, ...]]) -> float | None:
    """Sum over steps of the true error of the units a rule recovers in that step, over the
    sum of the largest errors of as many units (the decision at step t runs at step t+1)."""
    errors = trace.measured.get("oracle")
    if errors is None:
        return None
    caught = best = 0.0
    for decided, row in zip(decisions[:-1], errors[1:]):
        row = np.nan_to_num(row, nan=0.0)
        caught += float(row[list(decided)].sum())
        best += float(np.sort(row)[::-1][: len(decided)].sum())
    return caught / best if best > 0 else None


def settings(trace: Trace, args: argparse.Namespace) -> list[tuple[GNMRConfig, dict]]:
    recorded = {k: v for k, v in trace.config.items()
                if k in {f.name for f in dataclasses.fields(GNMRConfig)}}
    grid = {name: getattr(args, name, None) or [recorded.get(name, 0.0)] for name in SWEEPABLE}
    signal_grid = {name: getattr(args, name, None) or [trace.signal_settings.get(name)]
                   for name in SIGNAL_SWEEPABLE}
    out = []
    for values in itertools.product(*grid.values()):
        try:
            config = GNMRConfig(**{**recorded, **dict(zip(grid, values))})
        except ValueError as error:
            raise UserError(str(error)) from None
        for signal_values in itertools.product(*signal_grid.values()):
            chosen = {k: v for k, v in zip(signal_grid, signal_values) if v is not None}
            try:
                parse_signals(chosen.get("signals", "gnmr"))
            except ValueError as error:
                raise UserError(str(error)) from None
            out.append((config, chosen))
    return out


def run(args: argparse.Namespace) -> list[ReplayResult]:
    trace = read_trace(args.trace)
    gaps = list(iter_gaps(trace.steps))
    if gaps or (trace.steps and trace.steps[0] != 1):
        raise UserError(f"trace {args.trace}: steps are not contiguous from 1 (first gap at "
                        f"step {gaps[0] if gaps else trace.steps[0]}); record it with "
                        "--gnmr-trace-interval 1 to replay")
    results = []
    configs = settings(trace, args)
    print(f"replay of {args.trace}: {len(trace.steps)} steps x {len(trace.units)} units")
    for config, signal_settings in configs:
        result = replay(trace, config, show_progress=True, signal_settings=signal_settings)
        results.append(result)
        s = result.summary
        capture = "" if result.oracle_capture is None else \
            f", oracle capture {result.oracle_capture:.1%}"
        names = parse_signals(result.signal_settings["signals"])
        knobs = "".join(f"{knob}={result.signal_settings.get(knob, '-')} "
                        for knob in settings_of(names))
        print(f"signals={result.signal_settings['signals']} {knobs}"
              f"alpha={config.alpha} beta={config.beta} delta={config.delta} "
              f"max_o={config.max_o} t_lock={config.t_lock} warmup={config.warmup} "
              f"budget_rate={config.budget_rate}: "
              f"recovery sparsity {s['recovery_sparsity']:.4%}, exceedance rate "
              f"{s['exceedance_rate']:.4%}, switches/1k steps {s['switches_per_1k_steps']:.1f}"
              f"{capture}, same decisions as the live run at "
              f"{result.matches_recorded}/{len(trace.steps)} steps")
        top = ", ".join(f"{name} ({count})" for name, count in result.most_recovered[: args.top])
        print(f"    most recovered: {top or 'none'}")
    return results
