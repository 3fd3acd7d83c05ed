"""Run the real entry points as subprocesses (the way users launch them) and read results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

# A model small enough that a 2-process launch takes seconds; the data is the prepared
# Shakespeare corpus in the repository's cache (run_tests.sh prepares it).
TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
    "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "64",
    "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "3e-3",
    "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-iters", "2",
    "--data-cache-dir", str(REPO / ".cache" / "megatron_gnmr"),
]


def run_pretrain(args: list[str], nproc: int = 1, check: bool = True, timeout: int = 300,
                 extra_env: dict | None = None,
                 torchrun_args: list[str] = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(extra_env or {}))
    script = str(REPO / "pretrain_llama.py")
    if nproc == 1 and not torchrun_args:
        command = [PYTHON, script, *args]
    else:
        command = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *torchrun_args,
                   script, *args]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_jsonl(run_dir / "metrics.jsonl")
            if "train/loss" in r}


def trace_records(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "gnmr_trace.jsonl") if r.get("type") != "header"]
