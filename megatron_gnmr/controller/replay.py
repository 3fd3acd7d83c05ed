"""`megatron-gnmr replay`: re-run the policy offline on a recorded trace.

Each `--gnmr-*` flag takes one or more values; the sweep is their cartesian product, with
every flag not given taken from the config recorded in the trace. Given the live run's own
settings, the replay must make exactly the live run's decisions (it is checked and said).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from collections import Counter

from tqdm import tqdm

from megatron_gnmr.controller.config import GNMRConfig
from megatron_gnmr.controller.policy import GNMRPolicy
from megatron_gnmr.controller.trace import Trace, iter_gaps, read_trace
from megatron_gnmr.errors import UserError

SWEEPABLE = {"alpha": float, "beta": float, "delta": int, "max_o": None, "t_lock": int,
             "warmup": int}


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
    parser.add_argument("--top", type=int, default=5, help="most-recovered units to list")


@dataclasses.dataclass
class ReplayResult:
    config: GNMRConfig
    summary: dict
    most_recovered: list[tuple[str, int]]
    decisions: list[tuple[int, ...]]
    matches_recorded: int  # steps whose decision equals the recorded one


def replay(trace: Trace, config: GNMRConfig, show_progress: bool = False) -> ReplayResult:
    policy = GNMRPolicy(config, len(trace.units))
    counts: Counter[int] = Counter()
    decisions = []
    rows = tqdm(trace.norms, desc="replay", unit="step", disable=not show_progress, leave=False)
    for norms in rows:
        decision = policy.step(norms)
        counts.update(decision.recovery)
        decisions.append(decision.recovery)
    matches = sum(a == b for a, b in zip(decisions, trace.recovery))
    return ReplayResult(config, policy.summary(),
                        [(trace.units[u], c) for u, c in counts.most_common()],
                        decisions, matches)


def settings(trace: Trace, args: argparse.Namespace) -> list[GNMRConfig]:
    recorded = {k: v for k, v in trace.config.items()
                if k in {f.name for f in dataclasses.fields(GNMRConfig)}}
    grid = {name: getattr(args, name) or [recorded[name]] for name in SWEEPABLE}
    configs = []
    for values in itertools.product(*grid.values()):
        try:
            configs.append(GNMRConfig(**{**recorded, **dict(zip(grid, values))}))
        except ValueError as error:
            raise UserError(str(error)) from None
    return configs


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
    for config in configs:
        result = replay(trace, config, show_progress=True)
        results.append(result)
        s = result.summary
        print(f"alpha={config.alpha} beta={config.beta} delta={config.delta} "
              f"max_o={config.max_o} t_lock={config.t_lock} warmup={config.warmup}: "
              f"recovery sparsity {s['recovery_sparsity']:.4%}, exceedance rate "
              f"{s['exceedance_rate']:.4%}, switches/1k steps {s['switches_per_1k_steps']:.1f}, "
              f"same decisions as the live run at {result.matches_recorded}/{len(trace.steps)} "
              "steps")
        top = ", ".join(f"{name} ({count})" for name, count in result.most_recovered[: args.top])
        print(f"    most recovered: {top or 'none'}")
    return results
