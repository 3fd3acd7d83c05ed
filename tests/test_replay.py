"""`megatron-gnmr replay` on the trace of a real run."""

import subprocess
import sys

from megatron_gnmr.controller.config import GNMRConfig
from megatron_gnmr.controller.replay import replay
from megatron_gnmr.controller.trace import read_trace
from tests.helpers import LAUNCH_TIMEOUT_S, REPO, TINY, run_pretrain, trace_records

STEPS = 30
LIVE = {"alpha": 1.3, "beta": 1.1, "delta": 3, "max_o": 2, "t_lock": 2, "warmup": 4}


def test_replay_reproduces_the_live_run_and_sweeps(tmp_path):
    flags = [f"--gnmr-{k.replace('_', '-')}={v}" for k, v in LIVE.items()]
    run_pretrain([*TINY, "--train-iters", str(STEPS), "--eval-interval", "100", "--gnmr",
                  *flags, "--save", str(tmp_path)])
    recorded = [tuple(r["recovery"]) for r in trace_records(tmp_path)]
    assert len(recorded) == STEPS and any(recorded)

    trace = read_trace(str(tmp_path / "gnmr_trace.jsonl"))
    result = replay(trace, GNMRConfig(**LIVE))
    assert result.decisions == recorded
    other = replay(trace, GNMRConfig(**{**LIVE, "max_o": 1}))
    assert all(len(d) <= 1 for d in other.decisions) and other.decisions != recorded

    cli = subprocess.run(
        [sys.executable, "-m", "megatron_gnmr.cli", "replay", str(tmp_path / "gnmr_trace.jsonl"),
         "--gnmr-max-o", "1", "2", "3"], cwd=REPO, capture_output=True, text=True,
        timeout=LAUNCH_TIMEOUT_S)
    assert cli.returncode == 0, cli.stderr
    lines = [line for line in cli.stdout.splitlines() if "recovery sparsity" in line]
    assert len(lines) == 3
    live_line = next(line for line in lines if "max_o=2 " in line)
    assert f"same decisions as the live run at {STEPS}/{STEPS} steps" in live_line
