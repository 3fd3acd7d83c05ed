"""gpu_check's checkpoint rows: what a first cluster resume meets, on the device.

- save -> resume on the same layout: a run checkpointed at step N with --async-save (the
  writer forked while the next step trains) and stopped, then resumed, follows the
  uninterrupted run (on a GPU within `RESUME_TOLERANCE`: its kernels need not be bitwise
  repeatable; on a CPU bit for bit);
- a resume on another layout: the step-N checkpoint read into TP 2 over two GPUs where two are
  visible, else into a CPU process (another device than the one that wrote it: what a
  checkpoint holding device tensors, or read without `map_location`, breaks on), with the
  distributed optimizer saved fully reshardable; its first loss within `LAYOUT_TOLERANCE` of
  the uninterrupted run's.
Each is a launch of pretrain_llama.py, as a user starts one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESUME_TOLERANCE = 1e-3  # relative, on a GPU (non-deterministic reductions)
LAYOUT_TOLERANCE = 2e-2  # relative: another device or TP's order of sums
FLAGS = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable",
         "--lr-warmup-iters", "2", "--eval-interval", "100000", "--log-interval", "1"]


def _launch(args: list[str], processes: int = 1, cpu_only: bool = False) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    script = str(REPO / "pretrain_llama.py")
    command = [sys.executable, script, *args] if processes == 1 else \
        [str(Path(sys.executable).with_name("torchrun")), "--standalone",
         f"--nproc_per_node={processes}", script, *args]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr.strip()
                           else f"exit {result.returncode}")


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def _worst(got: dict[int, float], want: dict[int, float], steps) -> float:
    return max(abs(got[s] - want[s]) / abs(want[s]) for s in steps)


def rows(model: list[str], steps: int, on_gpu: bool, gpus: int) -> list[tuple[str, str, bool]]:
    """(check, detail, ok) per row."""
    half = max(steps // 2, 2)
    out = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        common = [*model, *FLAGS, "--train-iters", str(2 * half)]
        whole, parts = root / "whole", root / "parts"
        try:
            _launch([*common, "--save", str(whole), "--save-interval", str(half)])
            _launch([*common, "--save", str(parts), "--save-interval", str(half),
                     "--async-save", "--exit-interval", str(half)])
            _launch([*common, "--save", str(parts), "--resume", "auto", "--async-save"])
            worst = _worst(_losses(parts), _losses(whole), range(half + 1, 2 * half + 1))
            bound = RESUME_TOLERANCE if on_gpu else 0.0
            out.append(("save -> resume, same layout (async save)",
                        f"worst relative loss difference {worst:.1e} (bound {bound:g})",
                        worst <= bound))
        except RuntimeError as error:
            out.append(("save -> resume, same layout (async save)", str(error), False))
        other = root / "other"
        tp2 = gpus >= 2
        where = "TP 2 on 2 GPUs" if tp2 else "a CPU process"
        try:
            _launch([*common, "--load", str(whole), "--ckpt-step", str(half), "--save",
                     str(other), *(["--tensor-model-parallel-size", "2"] if tp2 else [])],
                    processes=2 if tp2 else 1, cpu_only=on_gpu and not tp2)
            worst = _worst(_losses(other), _losses(whole), [half + 1])
            out.append((f"resume on another layout ({where})",
                        f"first loss after the resume off by {worst:.1e} (bound "
                        f"{LAYOUT_TOLERANCE:g})", worst <= LAYOUT_TOLERANCE))
        except RuntimeError as error:
            out.append((f"resume on another layout ({where})", str(error), False))
    return out
