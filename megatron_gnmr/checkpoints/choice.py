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

from megatron_gnmr.checkpoints.formats import FORMATS, CheckpointFormat
from megatron_gnmr.errors import UserError


@dataclass
class Choice:
    directory: Path
    format: CheckpointFormat
    warnings: list[str] = field(default_factory=list)


def _candidates(load: str, wanted_step: int | None) -> list[tuple[Path, CheckpointFormat]]:
    per_format = [[(p, f) for p in f.candidates(load)] for f in FORMATS.values()]
    every = [c for found in per_format for c in found]
    if Path(load) in {p for p, _ in every}:
        return [c for c in every if c[0] == Path(load)]
    if wanted_step is not None:
        return [c for c in every if c[1].step_of(c[0]) == wanted_step][:1]

    def step(candidate: tuple[Path, CheckpointFormat]) -> int:
        return candidate[1].step_of(candidate[0]) or -1

    # each format's own pointer first among its own, the newer step first across formats
    merged = sorted(every, key=step, reverse=True)
    pointers = [found[0] for found in per_format if found]
    return sorted(pointers, key=step, reverse=True) + [c for c in merged if c not in pointers]


def newest_format(load: str) -> CheckpointFormat | None:
    """The format of the checkpoint `choose` would try first, read from this process's view
    of the files alone (not collective, no integrity check: what to set up before the
    process group exists)."""
    candidates = _candidates(load, None)
    return candidates[0][1] if candidates else None


def recorded_settings(load: str, step: int | None = None) -> tuple[Path, dict]:
    """The settings the checkpoint `choose` would try first recorded (flag -> value), read
    from this process's view of the files (not collective: what a command line is completed
    from before the process group exists; the load itself checks the hashes)."""
    for directory, fmt in _candidates(load, step):
        if fmt.problem_on_disk(directory) is None:
            return directory, fmt.record(directory).get("settings") or {}
    raise UserError(f"--load {load}: no complete checkpoint there to read its settings from")


def choose(load: str, step: int | None = None) -> Choice:
    """Collective: the same checkpoint on every rank (with `step`: that step's, or an
    error)."""
    rank = torch.distributed.get_rank()
    queue = _candidates(load, step) if rank == 0 else []
    warnings: list[str] = []
    while True:
        chosen = None
        while rank == 0 and queue and chosen is None:
            directory, fmt = queue.pop(0)
            problem = fmt.problem_on_disk(directory)
            if problem is None:
                chosen = (str(directory), fmt.name)
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
                            + ", or ".join(f.expected(load) for f in FORMATS.values()) + ")"
                            + (f"; {'; '.join(warnings)}" if warnings else ""))
        directory, fmt = Path(message[0][0]), FORMATS[message[0][1]]
        if fmt.hashes_match(directory):
            pending = fmt.hashes_pending(directory)
            return Choice(directory, fmt, warnings + ([pending] if pending else []))
        problem = "a file's sha256 differs from what was written (corrupt)"
        if Path(load) == directory or step is not None:
            raise UserError(f"--load {load}: {problem}; load an older checkpoint")
        warnings.append(f"skipped {directory}: {problem}")


def checkpoint_steps(run_dir: str) -> list[int]:
    """Every complete checkpoint's step, either format (the reuse check)."""
    return sorted({step for f in FORMATS.values() for step in f.checkpoint_steps(run_dir)})


def latest_step(run_dir: str) -> int | None:
    steps = checkpoint_steps(run_dir)
    return steps[-1] if steps else None
