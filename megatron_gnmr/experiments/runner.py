"""`megatron-gnmr reproduce SCENARIO`: run every (variant, seed) of a scenario, two at a
time on one thread each, and write the results table (JSON + markdown) and the report.

Each run is an ordinary `pretrain_llama.py` process with its own run directory under the
results directory, so any run can be inspected, replayed or reported on its own; a run
whose `summary.json` exists is not run again (an interrupted reproduction resumes), nor is
one whose summary is committed under docs/runs/SCENARIO from this CPU model (a round spread
over machines resumes from what landed; see committed_runs).
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
from megatron_gnmr.evaluation import output_name
from megatron_gnmr.experiments.scenario import Scenario, available, load_scenario, results_dir
from megatron_gnmr.experiments.tables import summarize, write_tables

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = str(REPO / ".cache" / "megatron_gnmr")  # the runs' default --data-cache-dir


def run_log(run_dir: Path) -> Path:
    """RUN_DIR.log beside the run directory: the whole name, since a variant's name may hold
    a dot (`fp8-lr0.024-seed1`), which `with_suffix` would cut at, giving two runs one log."""
    return run_dir.parent / f"{run_dir.name}.log"


def _run_logged(command: list[str], log: Path) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        return subprocess.run([sys.executable, *command], stdout=out, stderr=subprocess.STDOUT,
                              env=env, cwd=REPO).returncode


def _last_line(log: Path) -> str:
    """The log's last line: a crash's exception, where a run's failure shows first (a CI
    machine's report keeps the message, not the log)."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(its log is empty)"


def run_one(run_dir: Path, flags: list[str], evaluate: list[str] | None = None,
            evaluate_exact: bool = False) -> dict:
    """One run (skipped if its summary exists), then its evaluations (skipped likewise)."""
    log = run_log(run_dir)
    if not (run_dir / "summary.json").is_file():
        log.unlink(missing_ok=True)
        # --resume auto: a run interrupted after a checkpoint continues from it
        command = [str(REPO / "pretrain_llama.py"), *flags, "--save", str(run_dir),
                   "--resume", "auto"]
        record_provenance(run_dir, command)
        code = _run_logged(command, log)
        if code not in (0, 3):  # 3: the run stopped itself (recorded, not a crash)
            raise RuntimeError(f"run {run_dir.name} failed ({code}): {_last_line(log)}; "
                               f"see {log}")
    summary_path = run_dir / "summary.json"
    for exact in (False, True) if evaluate_exact else (False,):
        if evaluate is None or not summary_path.is_file() or \
                (run_dir / output_name(exact)).is_file():
            continue
        code = _run_logged(["-m", "megatron_gnmr.cli", "evaluate", str(run_dir), *evaluate,
                            *(["--exact"] if exact else [])], log)
        if code != 0:
            raise RuntimeError(f"the evaluation of {run_dir.name} failed ({code}): "
                               f"{_last_line(log)}; see {log}")
    return json.loads(summary_path.read_text()) if summary_path.is_file() else {}


def record_provenance(run_dir: Path, command: list[str]) -> None:
    """What a third party needs to check a run: its command line, the commit and packages it
    ran with, the CPU (runs pair bitwise on one CPU only). One line per start of the run (a
    resumed run appends its own), in `provenance.jsonl`."""
    from megatron_gnmr.experiments.provenance import provenance

    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "provenance.jsonl").open("a") as out:
        out.write(json.dumps(provenance(REPO, ["python", *command])) + "\n")


def pretrain(scenario: Scenario, smoke: bool, cache_dir: str) -> Path:
    """The scenario's base run (once; cached by its flags)."""
    base = scenario.pretrain_dir(cache_dir, smoke)
    if not (base / "summary.json").is_file():
        print(f"reproduce {scenario.name}: pretraining the base ({base})")
        run_one(base, scenario.pretrain_flags(smoke))
    return base


def reproduce(scenario: Scenario, out: Path, smoke: bool, jobs: int = 2,
              variants: list[str] | None = None, seeds: list[int] | None = None) -> dict:
    runs = scenario.runs(smoke)
    if seeds:
        unknown = sorted(set(seeds) - {seed for _, seed, _ in runs})
        if unknown:
            raise UserError(f"reproduce {scenario.name} --seeds: no seed "
                            f"{', '.join(map(str, unknown))} in the scenario")
        # seed by seed, every arm of a seed together: a run interrupted halfway leaves whole
        # seeds (the arms of a seed pair only when made on one machine)
        runs = sorted((run for run in runs if run[1] in seeds),
                      key=lambda run: seeds.index(run[1]))
    if variants:
        unknown = sorted(set(variants) - set(scenario.variants))
        if unknown:
            raise UserError(f"reproduce {scenario.name} --variants: no variant "
                            f"{', '.join(unknown)}; it has {', '.join(scenario.variants)}")
        runs = [run for run in runs if run[0] in variants]
    if not smoke:
        runs = _without_committed(scenario, runs)
        if not runs:
            print(f"reproduce {scenario.name}: every run is committed in docs/runs/"
                  f"{scenario.name}; the compare commands rebuild the tables from there")
            return {}
    start = time.time()
    if scenario.pretrain is not None:
        base = str(pretrain(scenario, smoke, CACHE_DIR).resolve())
        runs = [(v, s, [f.replace("{pretrain}", base) for f in flags]) for v, s, flags in runs]
    print(f"reproduce {scenario.name}{' (smoke)' if smoke else ''}: {len(runs)} runs, "
          f"{jobs} at a time -> {out}")
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_one, out / f"{variant}-seed{seed}", flags,
                               scenario.evaluate, scenario.evaluate_exact): (variant, seed)
                   for variant, seed, flags in runs}
        for future in tqdm(as_completed(futures), total=len(futures), desc=scenario.name,
                           unit="run"):
            future.result()
    if (variants and set(variants) != set(scenario.variants)) or seeds or \
            len(runs) < len(scenario.runs(smoke)):
        print(f"reproduce {scenario.name}: ran a part of it; the tables come once every "
              "variant and seed has run (or from compare-closed-loop)")
        return {}
    results = summarize(scenario, out, smoke)
    results["wall_time_s"] = round(time.time() - start, 1)
    write_tables(results, out)
    _report(scenario, out, runs)
    return results


def _without_committed(scenario: Scenario, runs) -> list:
    from megatron_gnmr.experiments.committed_runs import committed_summaries, runs_still_to_make
    from megatron_gnmr.experiments.provenance import cpu_name

    summaries = REPO / "docs" / "runs" / scenario.name
    committed = committed_summaries(summaries, {seed for _, seed, _ in runs})
    left = runs_still_to_make(runs, committed, cpu_name(), summaries)
    if len(left) < len(runs):
        print(f"reproduce {scenario.name}: {len(runs) - len(left)} runs committed in "
              f"{summaries.relative_to(REPO)} are not made again")
    return left


def _report(scenario: Scenario, out: Path, runs) -> None:
    from megatron_gnmr.observe.report import load_run, render_report

    first_seed = runs[0][1]
    logs = []
    for variant in scenario.variants:  # named by variant: `gnmr-4/8` would show as `8-seed1`
        log = load_run(str(out / f"{variant}-seed{first_seed}"))
        log.name = f"{variant}-seed{first_seed}"
        logs.append(log)
    figure = render_report(logs)
    figure.savefig(out / "report.png", dpi=100)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help=f"one of: {', '.join(available())}")
    parser.add_argument("--smoke", action="store_true", help="the one-minute size")
    parser.add_argument("--out", default=None, help="results directory "
                        "(default: results/SCENARIO[-smoke])")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    parser.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                        help="run these variants only (no tables until every variant has run)")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, metavar="SEED",
                        help="run these seeds only, seed by seed (no tables)")


def run(args: argparse.Namespace) -> dict:
    scenario = load_scenario(args.scenario)
    if args.jobs < 1:
        raise UserError("--jobs must be >= 1")
    out = results_dir(scenario, args.out, args.smoke)
    results = reproduce(scenario, out, args.smoke, args.jobs, args.variants, args.seeds)
    if results:
        print((out / "results.md").read_text())
    return results
