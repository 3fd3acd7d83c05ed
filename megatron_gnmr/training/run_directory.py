"""The run directory (`--save`): what a new run may do with one that already holds a run,
and the STOPPED marker that keeps torchrun from restarting a run that ended on purpose.

- A directory that holds checkpoints belongs to a run. A new launch into it must say what it
  wants: `--resume auto` (continue it), `--load` (start from a checkpoint), or `--overwrite`
  (delete its outputs and start over). Under torchrun restarts (`--max-restarts`) every
  attempt after the first resumes, as if `--resume auto` were given.
- A run that stopped itself (non-finite gradients, ranks that disagree: exit 3) leaves
  `STOPPED` with the reason. A torchrun restart attempt that finds it exits at once with the
  same status instead of training into the same stop again; a new launch (attempt 0) removes
  it and tries again.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from megatron_gnmr.checkpoints.choice import checkpoint_steps
from megatron_gnmr.errors import RunAborted, UserError

STOPPED = "STOPPED"
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "gnmr_trace.jsonl", "summary.json",
               "config.json", "report.png", STOPPED, "latest_checkpointed_iteration.txt")


def restart_attempt() -> int:
    """Which torchrun attempt this is (0: the launch itself)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def resumes(checkpoint) -> bool:
    """Whether the launch continues a run (a --finetune's --load is its base, not a run)."""
    starts_from_load = checkpoint.load is not None and not checkpoint.finetune
    return checkpoint.resume == "auto" or starts_from_load or restart_attempt() > 0


def check_run_directory(checkpoint) -> None:
    """Before anything is written: reusing a --save directory that holds a run is said
    explicitly."""
    save = checkpoint.save
    if save is None or not Path(save).is_dir():
        return
    steps = checkpoint_steps(save)
    if steps and not resumes(checkpoint) and not checkpoint.overwrite:
        raise UserError(f"--save {save} already holds checkpoints of a run (steps "
                        f"{steps[0]}..{steps[-1]}); continue it with --resume auto, start from "
                        "one with --load, or delete them with --overwrite")


def clear_for_overwrite(save: str) -> None:
    """`--overwrite`: remove the previous run's outputs (rank 0, after validation)."""
    from megatron_gnmr.checkpoints.torch_dist.files import step_of

    torch_dist = [p.name for p in Path(save).iterdir() if step_of(p) is not None
                  or p.name.startswith("iter_")] if Path(save).is_dir() else []
    for name in (*RUN_OUTPUTS, *torch_dist):
        target = Path(save) / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()


def mark_stopped(save: str, error: RunAborted, step: int) -> None:
    Path(save, STOPPED).write_text(json.dumps({
        "exit_code": error.exit_code, "step": step, "reason": str(error),
        "time": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))


class StoppedBefore(RunAborted):
    """A restart attempt of a run that had stopped on purpose (its marker stays as it is)."""


def honour_stop_marker(save: str | None) -> None:
    """A restart attempt of a run that stopped on purpose stops again at once (RunAborted);
    a new launch clears the marker."""
    if save is None:
        return
    marker = Path(save, STOPPED)
    if not marker.is_file():
        return
    if restart_attempt() == 0:
        marker.unlink(missing_ok=True)  # every rank gets here
        return
    try:
        record = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        record = {"step": "?", "reason": "unreadable STOPPED marker"}
    raise StoppedBefore(f"this run stopped on purpose at step {record.get('step')} "
                     f"({record.get('reason')}); torchrun restart attempt "
                     f"{restart_attempt()} does not train again. Fix the cause and relaunch "
                     f"(a new launch removes {marker})")
