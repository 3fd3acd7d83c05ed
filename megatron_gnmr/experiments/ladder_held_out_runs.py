"""The fault ladder's held-out round, run in the order that answers the most per CPU-hour
(issue 56): `python -m megatron_gnmr.experiments.ladder_held_out_runs --seeds 101 103 ...`.
Two processes, each on its own seeds, make the round two runs at a time
(scripts/reproduce/attention_ladder_heldout.sh); each run is one `megatron-gnmr reproduce`,
which skips a run whose summary exists, so an interrupted round resumes.

Four passes over each seed, the goal's runs first (`ladder_verdicts.complete` waits for the
first two and no more). A and B run seed by seed, both whole before the next seed starts:
machines change between sessions, and a seed's runs pair only on one CPU model, so a seed
left with only its pass A made would wait for that CPU model to come back. C and D follow,
pass by pass, over the seeds begun:
- pass A, per seed: every twin (short when it dies), exact attention, the healthy run, then on
  each rung whose twin died the chosen arm and TE's rule allowed to see O (TE's best in the
  training round);
- pass B, per seed: TE's rule latched and unlatched on each rung whose twin died;
- pass C, per seed: the arms the goal does not read (the first-layer rule, random);
- pass D, per seed: the twins that run alone (`ladder_held_out.SECONDARY`), on which every
  arm's rule is replayed, not run.
After each of A, B and C, per seed: `healthy-ARM` for each of that pass's arms whose replay
on the healthy trace fires; where it does not, the live run would be the healthy run bit for
bit. With `--new-seeds-for MINUTES` (a machine lent for a session) no seed is begun after
MINUTES, so the session's end strands no seed begun just before it; the seeds begun get C and
D.

An arm on a rung whose twin lived is not run: the verdicts (`ladder_goal.dying_seeds`)
judge an arm only on the seeds whose twin died.

A machine's run directories do not outlive it, so whether a twin died, and the healthy trace a
rule is replayed on, are read from the committed summaries and traces
(docs/runs/attention_ladder_heldout) when this machine did not make the run. A seed with runs
committed from another CPU model is skipped, named: its runs pair only on that model
(`committed_runs`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from megatron_gnmr.experiments.ladder import HEALTHY, TWIN_PREFIX
from megatron_gnmr.experiments.ladder_verdicts import arms_and_rungs

NAME = "attention_ladder_heldout"
# the goal's arms first (the chosen one and TE's), then the arms it does not read
PASSES = (("chosen", "te-o"), ("te-latch", "te-nolatch"), ("first-layer", "random", "gnmr"))
GOAL_PASSES = 2
TWINS_ALONE: tuple[str, ...] = ()  # the last pass has no arm: the twins that run alone


def schedule(seeds: list[int], may_start: Callable[[int], bool] = lambda seed: True
             ) -> Iterator[tuple[tuple[str, ...], int]]:
    """(a pass's arms, seed) in the order run: the goal's passes seed by seed, each seed whole
    before the next, then the other passes, the twins alone last, over the seeds begun.
    `may_start(seed)` is asked just before a seed's first pass: a seed it refuses is left to
    another session."""
    begun = []
    for seed in seeds:
        if may_start(seed):
            begun.append(seed)
            yield from ((arms, seed) for arms in PASSES[:GOAL_PASSES])
    yield from ((arms, seed) for arms in (*PASSES[GOAL_PASSES:], TWINS_ALONE) for seed in begun)


def pass_runs(scenario, seed: int, arms, died: Callable[[str, int], bool]) -> Iterator[str]:
    """A pass's runs of one seed before its healthy replays, in order; `died(variant, seed)`
    is asked once the twins have run."""
    _, rungs = arms_and_rungs(scenario)
    yield from [f"{TWIN_PREFIX}{rung}" for rung in rungs] + ["exact-attention", HEALTHY]
    for rung in rungs:
        if died(f"{TWIN_PREFIX}{rung}", seed):
            yield from (f"{arm}@{rung}" for arm in arms if f"{arm}@{rung}" in scenario.variants)


def secondary_twins(scenario) -> list[str]:
    """The twins with no arm: run alone, every arm's rule replayed on their traces."""
    _, rungs = arms_and_rungs(scenario)
    return [v for v in scenario.variants
            if v.startswith(TWIN_PREFIX) and v[len(TWIN_PREFIX):] not in rungs]


def healthy_runs(scenario, seed: int, arms, fires: Callable[[str, int], bool]) -> list[str]:
    """`healthy-ARM` of each arm whose rule, replayed on the seed's healthy trace, fires."""
    out = []
    for arm in arms:
        rule = next((v for v in scenario.variants if v.startswith(f"{arm}@")), None)
        if rule and f"{HEALTHY}-{arm}" in scenario.variants and fires(rule, seed):
            out.append(f"{HEALTHY}-{arm}")
    return out


def _reproduce(out: Path, variant: str, seed: int) -> None:
    subprocess.run([sys.executable, "-m", "megatron_gnmr.cli", "reproduce", NAME, "--jobs", "1",
                    "--out", str(out), "--variants", variant, "--seeds", str(seed)], check=False)


def died_reader(out: Path, summaries: Path) -> Callable[[str, int], bool]:
    from megatron_gnmr.experiments.closed_loop_runs import run_summary

    def died(variant: str, seed: int) -> bool:
        run_dir, committed = out / f"{variant}-seed{seed}", summaries / f"{variant}-seed{seed}.json"
        if (run_dir / "summary.json").is_file():
            return run_summary(run_dir)["diverged_at"] is not None
        return committed.is_file() and json.loads(committed.read_text())["diverged_at"] is not None
    return died


def fires_reader(scenario, out: Path, summaries: Path) -> Callable[[str, int], bool]:
    from megatron_gnmr.experiments import detection_traces
    from megatron_gnmr.experiments.held_out import fires_on

    def fires(rule: str, seed: int) -> bool:
        healthy, trace = out / f"{HEALTHY}-seed{seed}", out / f"{HEALTHY}-seed{seed}.npz"
        if (healthy / "summary.json").is_file() and not trace.is_file():
            detection_traces.write(healthy, trace)
        if not trace.is_file():
            trace = summaries / "traces" / f"{HEALTHY}-seed{seed}.npz"
        if not trace.is_file():
            return False
        return fires_on(detection_traces.read(trace).trace, scenario, rule, seed) is not None
    return fires


def seeds_made_here(seeds: list[int], summaries: Path, cpu: str) -> list[int]:
    """`seeds` less those with a run committed from another CPU model, each named."""
    from megatron_gnmr.experiments.committed_runs import committed_summaries, made_elsewhere

    committed, here = committed_summaries(summaries, seeds), []
    for seed in seeds:
        elsewhere = made_elsewhere(committed, seed, cpu)
        if elsewhere:
            print(f"{NAME}: seed {seed} skipped, its runs pair only on one CPU model: "
                  f"{len(elsewhere)} committed from another ({elsewhere[0]}, ...), this "
                  f"machine is {cpu}", flush=True)
        else:
            here.append(seed)
    return here


def starts_within(minutes: float | None, summaries: Path, out: Path,
                  clock: Callable[[], float] = time.monotonic) -> Callable[[int], bool]:
    """`may_start` for `schedule`: a seed nothing of which is made yet starts only within
    `minutes` of now; one with a run committed or begun here goes on (it is this CPU
    model's already)."""
    from megatron_gnmr.experiments.committed_runs import committed_summaries

    deadline = None if minutes is None else clock() + 60 * minutes

    def may_start(seed: int) -> bool:
        made = bool(committed_summaries(summaries, [seed])) or any(out.glob(f"*-seed{seed}"))
        if made or deadline is None or clock() < deadline:
            return True
        print(f"{NAME}: seed {seed} not begun: --new-seeds-for {minutes:g} minutes have "
              "passed (a seed begun and left half-made waits for this CPU model)", flush=True)
        return False
    return may_start


def main(argv: list[str] | None = None) -> None:
    from megatron_gnmr.experiments.provenance import cpu_name
    from megatron_gnmr.experiments.runner import REPO
    from megatron_gnmr.experiments.scenario import load_scenario

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", nargs="+", type=int, required=True)
    parser.add_argument("--out", type=Path, default=Path("results") / NAME)
    parser.add_argument("--new-seeds-for", type=float, default=None, metavar="MINUTES",
                        help="begin no new seed after MINUTES (a machine lent for a while: "
                        "the goal's runs of a seed take about 2 hours of one core); the "
                        "seeds begun then get the other passes")
    args = parser.parse_args(argv)
    if args.new_seeds_for is not None and args.new_seeds_for < 0:
        parser.error("--new-seeds-for must be >= 0 minutes")
    scenario = load_scenario(NAME)
    summaries = REPO / "docs" / "runs" / NAME
    seeds = seeds_made_here(args.seeds, summaries, cpu_name())
    died, fires = died_reader(args.out, summaries), fires_reader(scenario, args.out, summaries)
    may_start = starts_within(args.new_seeds_for, summaries, args.out)
    for arms, seed in schedule(seeds, may_start):
        if arms == TWINS_ALONE:
            for variant in secondary_twins(scenario):
                _reproduce(args.out, variant, seed)
            continue
        for variant in pass_runs(scenario, seed, arms, died):
            _reproduce(args.out, variant, seed)
        for variant in healthy_runs(scenario, seed, arms, fires):
            _reproduce(args.out, variant, seed)


if __name__ == "__main__":
    main()
