"""Compact per-run summaries, committed beside the docs so that a comparison's tables are
rebuilt from the repository alone (no run directories, no checkpoints): where they live
(`--runs`, `--summaries`) and how they are gathered. Used by `compare-closed-loop` and
`compare-frontier`, each with its own summary of one run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

from megatron_gnmr.experiments.scenario import Scenario, load_scenario, results_dir


def add_location_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", default=None, help="its run directories (default: "
                        "results/SCENARIO)")
    parser.add_argument("--summaries", default=None, help="the compact per-run summaries "
                        "(default: docs/runs/SCENARIO, committed)")


def locations(args: argparse.Namespace) -> tuple[Scenario, Path, Path]:
    """The scenario named by `args.scenario`, its run directories and its summaries."""
    scenario = load_scenario(args.scenario)
    runs = Path(args.runs) if args.runs else results_dir(scenario, None, smoke=False)
    return scenario, runs, Path(args.summaries or f"docs/runs/{scenario.name}")


def collect(scenario: Scenario, runs: Path, summaries: Path,
            summarize: Callable[[Path], dict]) -> dict[str, dict[int, dict]]:
    """A summary of every finished run under `runs` that `summaries` does not hold yet
    (written once: a summary records the machine its run was made on), then every summary
    there read back: {variant: {seed: summary}}."""
    summaries.mkdir(parents=True, exist_ok=True)
    table: dict[str, dict[int, dict]] = {}
    for variant, seed, _ in scenario.runs(smoke=False):
        run_dir, path = runs / f"{variant}-seed{seed}", summaries / f"{variant}-seed{seed}.json"
        if (run_dir / "summary.json").is_file() and not path.is_file():
            path.write_text(json.dumps(summarize(run_dir), indent=1) + "\n")
        if path.is_file():
            table.setdefault(variant, {})[seed] = json.loads(path.read_text())
    return table
