"""Which checkpoint a resume loads, whatever its format: the newest intact one.

A run directory may hold checkpoints of both formats (`--ckpt-format torch` under
`checkpoints/`, `torch_dist` in Megatron-LM's layout at its top); a resume loads the newest
complete one of either, as Megatron-LM's `--auto-detect-ckpt-format` does, each format
checking its own files: rank 0 passes over what is missing or of the wrong size, then every
rank checks hashes (its own shard, or its share of the files) and a candidate any rank finds
corrupt is passed over with a warning. An `iter_*` directory given directly is loaded or
refused, never replaced by another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_gnmr.errors import UserError
from megatron_gnmr.training import checkpoint
from megatron_gnmr.training.torch_dist import files as dist_files


@dataclass
class Choice:
    directory: Path
    format: str
    warnings: list[str] = field(default_factory=list)


STEP_OF = {"torch": checkpoint.step_of, "torch_dist": dist_files.step_of}


def _candidates(load: str, wanted_step: int | None) -> list[tuple[Path, str]]:
    torch_format = [(p, "torch") for p in checkpoint.candidates(load)]
    dist = [(p, "torch_dist") for p in dist_files.candidates(load)]
    if Path(load) in {p for p, _ in torch_format + dist}:
        return [c for c in torch_format + dist if c[0] == Path(load)]
    if wanted_step is not None:
        return [c for c in torch_format + dist if STEP_OF[c[1]](c[0]) == wanted_step][:1]
    step = STEP_OF
    # each format's own pointer first among its own, the newer step first across formats
    merged = sorted(torch_format + dist, key=lambda c: step[c[1]](c[0]) or -1, reverse=True)
    pointers = [c for c in (torch_format[:1] + dist[:1])]
    return sorted(pointers, key=lambda c: step[c[1]](c[0]) or -1, reverse=True) + \
        [c for c in merged if c not in pointers]


def newest_format(load: str) -> str | None:
    """The format of the checkpoint `choose` would try first, read from this process's view
    of the files alone (not collective, no integrity check: what to set up before the
    process group exists)."""
    candidates = _candidates(load, None)
    return candidates[0][1] if candidates else None


def recorded_settings(load: str, step: int | None = None) -> tuple[Path, dict]:
    """The settings the checkpoint `choose` would try first recorded (flag -> value), read
    from this process's view of the files (not collective: what a command line is completed
    from before the process group exists; the load itself checks the hashes)."""
    for directory, kind in _candidates(load, step):
        if _problem(directory, kind) is None:
            record = dist_files.read_manifest(directory) if kind == "torch_dist" else \
                checkpoint.read_meta(directory)
            return directory, record.get("settings") or {}
    raise UserError(f"--load {load}: no complete checkpoint there to read its settings from")


def _problem(directory: Path, kind: str) -> str | None:
    return dist_files.problem_on_disk(directory) if kind == "torch_dist" else \
        checkpoint.intact_on_disk(directory)


def _hashes_match(directory: Path, kind: str) -> bool:
    if kind == "torch_dist":
        return dist_files.hashes_match(directory)
    from megatron_gnmr.platform.device import run_device

    intact = torch.tensor([checkpoint.shard_matches(directory, torch.distributed.get_rank())],
                          device=run_device())
    torch.distributed.all_reduce(intact, op=torch.distributed.ReduceOp.MIN)
    return int(intact) == 1


def choose(load: str, step: int | None = None) -> Choice:
    """Collective: the same checkpoint on every rank (with `step`: that step's, or an
    error)."""
    rank = torch.distributed.get_rank()
    queue = _candidates(load, step) if rank == 0 else []
    warnings: list[str] = []
    while True:
        chosen = None
        while rank == 0 and queue and chosen is None:
            directory, kind = queue.pop(0)
            problem = _problem(directory, kind)
            if problem is None:
                chosen = (str(directory), kind)
            else:
                warnings.append(f"skipped {directory}: {problem}")
        message = [chosen, warnings]
        torch.distributed.broadcast_object_list(message, src=0)
        warnings = message[1]
        if message[0] is None and step is not None:
            raise UserError(f"--ckpt-step {step}: no complete checkpoint of that step in "
                            f"--load {load} (its steps: "
                            f"{', '.join(map(str, checkpoint_steps(load))) or 'none'})"
                            + (f"; {'; '.join(warnings)}" if warnings else ""))
        if message[0] is None:
            raise UserError(f"--load {load}: no complete checkpoint there (expected "
                            f"{load}/iter_* with {dist_files.MANIFEST}, or "
                            f"{checkpoint.checkpoint_root(load)}/iter_* with meta.json)"
                            + (f"; {'; '.join(warnings)}" if warnings else ""))
        directory, kind = Path(message[0][0]), message[0][1]
        if _hashes_match(directory, kind):
            pending = dist_files.hashes_pending(directory) if kind == "torch_dist" else None
            return Choice(directory, kind, warnings + ([pending] if pending else []))
        problem = "a file's sha256 differs from what was written (corrupt)"
        if Path(load) == directory or step is not None:
            raise UserError(f"--load {load}: {problem}; load an older checkpoint")
        warnings.append(f"skipped {directory}: {problem}")


def checkpoint_steps(run_dir: str) -> list[int]:
    """Every complete checkpoint's step, either format (the reuse check)."""
    return sorted(set(checkpoint.checkpoint_steps(run_dir)) |
                  set(dist_files.checkpoint_steps(run_dir)))


def latest_step(run_dir: str) -> int | None:
    steps = checkpoint_steps(run_dir)
    return steps[-1] if steps else None
