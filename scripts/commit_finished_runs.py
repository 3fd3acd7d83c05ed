"""Commit each finished run's summary and trace as it finishes (the rounds' convention: a
machine's run directories do not outlive its session, what landed does). Every `--every`
minutes, for each scenario: the compact summary of every finished run under
RESULTS/SCENARIO that docs/runs/SCENARIO does not hold yet (it records the CPU model), the
detection trace of each twin and healthy run (as the fault ladder's rounds keep them:
`ladder.collect_traces`), then one commit of those files only, named by run and CPU model.
Run it from the checkout that lands, beside the round's runners:

    .venv/bin/python scripts/commit_finished_runs.py attention_ladder_heldout \\
        [--results /work/results] [--every 10] [--once]
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

from megatron_gnmr.experiments.closed_loop_runs import run_summary
from megatron_gnmr.experiments.ladder import collect_traces
from megatron_gnmr.experiments.provenance import cpu_name
from megatron_gnmr.experiments.run_summaries import collect
from megatron_gnmr.experiments.scenario import load_scenario

REPO = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True,
                          text=True).stdout


def commit_finished(name: str, results: Path) -> list[str]:
    """The runs of scenario `name` committed now."""
    runs, summaries = results / name, REPO / "docs" / "runs" / name
    if not runs.is_dir():
        return []
    scenario = load_scenario(name)
    collect(scenario, runs, summaries, run_summary)
    collect_traces(scenario, runs, summaries / "traces")
    new = [line[3:] for line in git("status", "--porcelain", "--untracked-files=all", "--",
                                    str(summaries)).splitlines() if line.startswith("?? ")]
    finished = sorted(Path(path).stem for path in new if path.endswith(".json"))
    if finished:
        git("add", "--", *new)
        git("commit", "-q", "-m", f"{name}: {len(finished)} runs' summaries and traces "
            f"({cpu_name()}), as they finish: {', '.join(finished)}", "--", *new)
    return finished


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="+")
    parser.add_argument("--results", type=Path, default=REPO / "results")
    parser.add_argument("--every", type=float, default=10.0, metavar="MINUTES")
    parser.add_argument("--once", action="store_true", help="commit what finished, then stop")
    args = parser.parse_args()
    while True:
        for name in args.scenarios:
            finished = commit_finished(name, args.results)
            if finished:
                print(time.strftime("%H:%M"), name, "committed:", ", ".join(finished),
                      flush=True)
        if args.once:
            return
        time.sleep(60 * args.every)


if __name__ == "__main__":
    main()
