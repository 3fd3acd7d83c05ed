"""Runs a reproduction need not make again: those whose compact summary is committed under
docs/runs/SCENARIO. A machine's run directories do not outlive it, the committed summaries
do, so a round spread over several machines resumes from what landed.

Runs pair (a twin beside its healthy run, an arm beside its rival) only when made on one CPU
model: GEMMs round differently on another. So a committed run is reused only where it was
made on this machine's CPU model, and a seed part-made on another CPU model is refused by
name rather than finished here and mixed. Should that CPU model not come back, the seed's runs
move to docs/runs/SCENARIO/superseded/ (read by no runner, so the seed is made again whole
here) and are kept there, listed and never judged."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_gnmr.errors import UserError

SUPERSEDED = "superseded"


def committed_summaries(summaries: Path, seeds) -> dict[tuple[str, int], dict]:
    """{(variant, seed): summary} for every run of `seeds` whose summary `summaries` holds,
    whatever its variant: a seed's CPU model is that of every run of it that landed, not
    only of the runs asked for now."""
    found = {}
    for seed in sorted(set(seeds)):
        suffix = f"-seed{seed}"
        for path in summaries.glob(f"*{suffix}.json"):
            found[(path.stem[: -len(suffix)], seed)] = json.loads(path.read_text())
    return found


def made_elsewhere(committed: dict[tuple[str, int], dict], seed: int, cpu: str) -> list[str]:
    """'VARIANT (CPU)' for each committed run of `seed` made on a CPU model other than `cpu`."""
    return [f"{variant} ({summary.get('cpu', 'an unrecorded CPU')})"
            for (variant, s), summary in sorted(committed.items())
            if s == seed and summary.get("cpu") != cpu]


def runs_still_to_make(runs, committed: dict[tuple[str, int], dict], cpu: str,
                       summaries: Path) -> list:
    """`runs` less those committed. A seed with a run still to make is refused when any run
    of it, asked for or not, was committed on another CPU model (a seed whose runs asked for
    are all committed needs nothing made, so it is kept whole wherever it was made)."""
    left = [run for run in runs if (run[0], run[1]) not in committed]
    for seed in sorted({seed for _, seed, _ in left}):
        elsewhere = made_elsewhere(committed, seed, cpu)
        if elsewhere:
            raise UserError(
                f"reproduce: seed {seed} is part-made on another CPU model: "
                f"{', '.join(elsewhere)} committed in {summaries}, this machine is {cpu}. "
                f"Its runs pair only on one CPU model: finish the seed there, or move its "
                f"committed summaries and traces to {summaries / SUPERSEDED}/ (kept, never "
                f"judged) to make the whole seed here")
    return left


def superseded_seeds(summaries: Path) -> dict[int, dict]:
    """{seed: {"runs": how many, "cpus": [...]}} for the runs moved to SUMMARIES/superseded/."""
    seeds: dict[int, dict] = {}
    for path in sorted((summaries / SUPERSEDED).glob("*-seed*.json")):
        seed = int(path.stem.rpartition("-seed")[2])
        entry = seeds.setdefault(seed, {"runs": 0, "cpus": []})
        entry["runs"] += 1
        cpu = json.loads(path.read_text()).get("cpu") or "an unrecorded CPU"
        if cpu not in entry["cpus"]:
            entry["cpus"].append(cpu)
    return seeds
