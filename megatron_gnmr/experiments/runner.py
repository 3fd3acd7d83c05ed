"""`megatron-gnmr reproduce SCENARIO`: run every (variant, seed) of a scenario, two at a
time on one thread each, and write the results table (JSON + markdown) and the report.

Each run is an ordinary `pretrain_llama.py` process with its own run directory under the
results directory, so any run can be inspected, replayed or reported on its own; a run
whose `summary.json` exists is not run again (an interrupted reproduction resumes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from tqdm import tqdm

from megatron_gnmr.errors import UserError
from megatron_gnmr.experiments.scenario import Scenario, available, load_scenario, results_dir
from megatron_gnmr.experiments.tables import summarize, write_tables

REPO = Path(__file__).resolve().parents[2]


def run_one(run_dir: Path, flags: list[str]) -> dict:
    if (run_dir / "summary.json").is_file():
        return json.loads((run_dir / "summary.json").read_text())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    log = run_dir.with_suffix(".log")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        result = subprocess.run([sys.executable, str(REPO / "pretrain_llama.py"), *flags,
                                 "--save", str(run_dir)], stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=REPO)
    if result.returncode not in (0, 3):  # 3: the run stopped itself (recorded, not a crash)
        raise RuntimeError(f"run {run_dir.name} failed ({result.returncode}); see {log}")
    summary_path = run_dir / "summary.json"
    return json.loads(summary_path.read_text()) if summary_path.is_file() else {}


def reproduce(scenario: Scenario, out: Path, smoke: bool, jobs: int = 2) -> dict:
    runs = scenario.runs(smoke)
    print(f"reproduce {scenario.name}{' (smoke)' if smoke else ''}: {len(runs)} runs, "
          f"{jobs} at a time -> {out}")
    start = time.time()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_one, out / f"{variant}-seed{seed}", flags): (variant, seed)
                   for variant, seed, flags in runs}
        for future in tqdm(as_completed(futures), total=len(futures), desc=scenario.name,
                           unit="run"):
            future.result()
    results = summarize(scenario, out, smoke)
    results["wall_time_s"] = round(time.time() - start, 1)
    write_tables(results, out)
    _report(scenario, out, runs)
    return results


def _report(scenario: Scenario, out: Path, runs) -> None:
    from megatron_gnmr.observe.report import load_run, render_report

    first_seed = runs[0][1]
    dirs = [out / f"{variant}-seed{first_seed}" for variant in scenario.variants]
    figure = render_report([load_run(str(d)) for d in dirs])
    figure.savefig(out / "report.png", dpi=100)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help=f"one of: {', '.join(available())}")
    parser.add_argument("--smoke", action="store_true", help="the one-minute size")
    parser.add_argument("--out", default=None, help="results directory "
                        "(default: results/SCENARIO[-smoke])")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")


def run(args: argparse.Namespace) -> dict:
    scenario = load_scenario(args.scenario)
    if args.jobs < 1:
        raise UserError("--jobs must be >= 1")
    out = results_dir(scenario, args.out, args.smoke)
    results = reproduce(scenario, out, args.smoke, args.jobs)
    print((out / "results.md").read_text())
    return results
