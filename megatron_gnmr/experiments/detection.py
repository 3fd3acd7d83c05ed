"""`megatron-gnmr compare-detectors SCENARIO`: which alarm is both early and specific, from
the committed detection traces alone (`detection_traces.py`).

A scenario for this has, per seed, a `twin` (the fault on the layers its seed draws, every
detector's quantities measured, no control) and a `healthy` run (the same low path without the
fault). For every setting of every detector family (`detectors.py`) and every seed:
- on the twin, when it died (the divergence rule of section 3): its first alarm (step and
  units, as a live run's first recovery), whether that alarm named only faulted layers (the
  "where"), its lead over the twin's death and over the onset of harm: the first step from
  which the twin's loss, as a 100-step running mean of its difference to the healthy run of
  the same seed (same data, same initial weights), stays above the harm margin (twice the
  seed-to-seed standard deviation of the healthy runs' final losses) until the twin dies;
- on the healthy run: whether it ever fires (a live run of that setting would then spend
  exact attention for nothing: that run must be made, not predicted), and when first.
Twins that never die (the fault on a layer it does not kill) are counted apart.

The choice (`choose`): among settings that fire on no healthy run, the one that alarms
before the onset of harm on the right layer on the most dying twins, then the longest
median lead over the onset. Transformer Engine's rule at its tuned thresholds: te-unit's
best setting by the same measure. Writes DIR/detection.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megatron_gnmr.errors import UserError
from megatron_gnmr.experiments import detection_traces
from megatron_gnmr.experiments.closed_loop_statistics import harm_margin
from megatron_gnmr.experiments.detectors import (
    FAMILIES,
    Alarm,
    Setting,
    first_alarm,
    settings,
    spend,
)
from megatron_gnmr.experiments.run_summaries import add_location_arguments, locations

TWIN, HEALTHY = "twin", "healthy"
ONSET_WINDOW = 100
FINAL_STEPS = 300


def harm_onset(twin_loss: np.ndarray, healthy_loss: np.ndarray, margin: float,
               window: int = ONSET_WINDOW) -> int | None:
    """The first step from which the `window`-step running mean of twin - healthy stays above
    `margin` to the twin's last step (None: it does not end above)."""
    steps = min(len(twin_loss), len(healthy_loss))
    if steps < window:
        return None
    difference = twin_loss[:steps] - healthy_loss[:steps]
    running = np.convolve(difference, np.ones(window) / window, mode="valid")  # ends at w..n
    above = running > margin
    if not above[-1]:
        return None
    last_below = np.flatnonzero(~above)
    return int((last_below[-1] + 1 if len(last_below) else 0) + window)


@dataclass
class SeedCase:
    seed: int
    twin: detection_traces.DetectionTrace
    healthy: detection_traces.DetectionTrace
    onset: int | None

    @property
    def died(self) -> bool:
        return self.twin.diverged_at is not None


@dataclass
class Row:
    """One setting over the seeds."""

    label: str
    family: str
    value: object
    dying: int
    early_and_right: int  # alarmed before the onset of harm, naming only faulted layers
    before_death: int
    right_layer: int
    lead_over_onset: float | None  # median over the dying twins it alarmed on
    lead_over_death: float | None
    healthy: int
    healthy_fired: int
    first_false_alarm: float | None  # median step
    lived: int
    lived_fired: int
    alarms: dict  # seed -> [step, [layers]] on the twin (None: no alarm)


def _layers(alarm: Alarm | None, units: list[str]) -> list[int]:
    return [] if alarm is None else sorted({int(units[u].split(".")[1]) for u in alarm.units})


def _median(values: list) -> float | None:
    return statistics.median(values) if values else None


def evaluate(setting: Setting, cases: list[SeedCase]) -> Row:
    dying = [c for c in cases if c.died]
    lived = [c for c in cases if not c.died]
    early = before_death = right = 0
    onset_leads, death_leads, alarms = [], [], {}
    for case in cases:
        alarm = first_alarm(case.twin.trace, setting)
        layers = _layers(alarm, case.twin.trace.units)
        alarms[case.seed] = None if alarm is None else [alarm.step, layers]
        if not case.died or alarm is None:
            continue
        acts = alarm.step + 1
        named_right = set(layers) <= set(case.twin.fault_layers)
        right += named_right
        if acts <= case.twin.diverged_at:
            before_death += 1
            death_leads.append(case.twin.diverged_at - acts)
        if case.onset is not None and acts <= case.onset:
            onset_leads.append(case.onset - acts)
            early += named_right
    false_alarms = [a.step for a in (first_alarm(c.healthy.trace, setting) for c in cases)
                    if a is not None]
    lived_fired = sum(alarms[c.seed] is not None for c in lived)
    return Row(setting.label, setting.family, setting.value, len(dying), early, before_death,
               right, _median(onset_leads), _median(death_leads), len(cases), len(false_alarms),
               _median(false_alarms), len(lived), lived_fired, alarms)


def choose(rows: list[Row], family: str | None = None) -> Row | None:
    """The setting the held-out round runs (of `family`, or of any): no healthy run fired;
    then the most dying twins alarmed early on the right layer; then the longest median lead
    over the onset; then the most dying twins alarmed before death; then the highest
    threshold. For TE's rule, its best thresholds by the same measure."""
    quiet = [r for r in rows if r.healthy_fired == 0 and (family is None or r.family == family)]
    # among settings equal on all three, the last of its family's grid: the highest
    # threshold, the furthest from firing on a healthy run
    return max(reversed(quiet), key=lambda r: (r.early_and_right, r.lead_over_onset or 0.0,
                                               r.before_death), default=None)


def load_cases(traces: Path, seeds: list[int] | None,
               twin: str = TWIN) -> tuple[list[SeedCase], float]:
    """Every seed with both traces (of `seeds`; the twin is the variant `twin`), and the harm
    margin they give."""
    found = {}
    for path in sorted(traces.glob("*.npz")):
        variant, _, seed = path.stem.rpartition("-seed")
        if variant in (twin, HEALTHY) and seed.isdigit():
            found.setdefault(int(seed), {})[TWIN if variant == twin else variant] = \
                detection_traces.read(path)
    pairs = {seed: runs for seed, runs in found.items()
             if len(runs) == 2 and (seeds is None or seed in seeds)}
    if len(pairs) < 2:
        raise UserError(f"compare-detectors: {traces} holds {len(pairs)} seed(s) with both a "
                        f"{TWIN} and a {HEALTHY} trace; at least 2 are needed")
    finals = [float(np.mean(runs[HEALTHY].loss[-FINAL_STEPS:])) for runs in pairs.values()]
    margin = harm_margin(finals)
    return [SeedCase(seed, runs[TWIN], runs[HEALTHY],
                     harm_onset(runs[TWIN].loss, runs[HEALTHY].loss, margin)
                     if runs[TWIN].diverged_at is not None else None)
            for seed, runs in sorted(pairs.items())], margin


def collect(scenario, runs: Path, traces: Path) -> None:
    """A detection trace of every finished twin and healthy run under `runs` that `traces`
    does not hold yet (written once: a trace records the machine its run was made on)."""
    for variant, seed, _ in scenario.runs(smoke=False):
        run_dir, path = runs / f"{variant}-seed{seed}", traces / f"{variant}-seed{seed}.npz"
        if variant in (TWIN, HEALTHY) and (run_dir / "summary.json").is_file() and \
                not path.is_file():
            detection_traces.write(run_dir, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="a detection scenario (configs/scenarios/)")
    add_location_arguments(parser)
    parser.add_argument("--seeds", nargs="+", type=int, default=None,
                        help="the seeds to judge on (default: every seed with both traces)")
    parser.add_argument("--families", nargs="+", default=None,
                        choices=[f.name for f in FAMILIES], help="the detector families")


def run(args: argparse.Namespace) -> dict:
    from megatron_gnmr.experiments.detection_report import write_report

    scenario, runs, summaries = locations(args)
    traces = summaries / "traces"
    if runs.is_dir():
        collect(scenario, runs, traces)
    cases, margin = load_cases(traces, args.seeds)
    rows = [evaluate(setting, cases)
            for setting in tqdm(settings(args.families), desc="detectors", unit="setting")]
    chosen, rival = choose(rows), choose(rows, "te-unit")
    budget = None if chosen is None else statistics.fmean(
        spend(c.twin.trace, Setting(chosen.family, chosen.value)) for c in cases if c.died)
    result = {"seeds": [c.seed for c in cases], "harm_margin": margin,
              "cases": {c.seed: {"fault_layers": c.twin.fault_layers,
                                 "died_at": c.twin.diverged_at, "onset": c.onset,
                                 "cpu": c.twin.provenance.get("cpu")} for c in cases},
              "rows": [asdict(r) for r in rows],
              "chosen": chosen.label if chosen else None,
              "chosen_spend_on_dying": budget,
              "te_tuned": rival.label if rival else None}
    suffix = "" if args.seeds is None else "-" + "-".join(map(str, args.seeds))
    (summaries / f"detection{suffix}.json").write_text(json.dumps(result, indent=1) + "\n")
    write_report(result, rows, summaries / f"detection{suffix}")
    print((summaries / f"detection{suffix}.md").read_text())
    return result
