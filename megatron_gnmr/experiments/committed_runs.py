"""Runs a reproduction need not make again: those whose compact summary is committed under
docs/runs/SCENARIO. A machine's run directories do not outlive it, the committed summaries
do, so a round spread over several machines resumes from what landed.

Runs pair (a twin beside its healthy run, an arm beside its rival) only when made on one CPU
model: GEMMs round differently on another. So a committed run is reused only where it was
made on this machine's CPU model, and a seed part-made on another CPU model is refused by
name rather than finished here and mixed."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_gnmr.errors import UserError


def committed_summaries(summaries: Path, runs) -> dict[tuple[str, int], dict]:
    """{(variant, seed): summary} for every run of `runs` whose summary `summaries` holds."""
    found = {}
    for variant, seed, _ in runs:
        path = summaries / f"{variant}-seed{seed}.json"
        if path.is_file():
            found[(variant, seed)] = json.loads(path.read_text())
    return found


def runs_still_to_make(runs, committed: dict[tuple[str, int], dict], cpu: str,
                       summaries: Path) -> list:
    """`runs` less those committed on `cpu`. A seed with a run committed on another CPU model
    is refused unless every one of its runs is committed (then it is whole and pairs)."""
    seeds = sorted({seed for _, seed, _ in runs})
    for seed in seeds:
        arms = [variant for variant, s, _ in runs if s == seed]
        if all((variant, seed) in committed for variant in arms):
            continue
        elsewhere = [f"{variant} ({committed[(variant, seed)].get('cpu', 'an unrecorded CPU')})"
                     for variant in arms if (variant, seed) in committed
                     and committed[(variant, seed)].get("cpu") != cpu]
        if elsewhere:
            raise UserError(
                f"reproduce: seed {seed} is part-made on another CPU model: "
                f"{', '.join(elsewhere)} committed in {summaries}, this machine is {cpu}. "
                f"Its runs pair only on one CPU model: finish the seed there, or delete its "
                f"committed summaries (and traces) to make the whole seed here")
    return [run for run in runs if (run[0], run[1]) not in committed]
