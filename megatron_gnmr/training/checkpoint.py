"""Checkpoints that are either complete or invisible.

Layout: `<dir>/checkpoints/iter_0000100/{rank_00000.pt, ..., meta.json}` and
`<dir>/checkpoints/latest` naming the newest complete one. Every rank writes its own
shard (model, optimizer, scheduler, RNG, data position, controller state) into
`iter_*.tmp/` under a temporary file name; after a barrier rank 0 writes `meta.json`,
renames the directory, and only then replaces `latest` (write-then-rename). A kill at any
moment leaves the previous checkpoint and `latest` untouched.

Why not megatron's `dist_checkpointing`: it reshards across layouts, which this project does
not need yet, and its CPU path was not verified here; the per-rank format below is exact
for a fixed layout and the layout is checked on load.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from megatron.core import tensor_parallel

from megatron_gnmr.errors import UserError
from megatron_gnmr.platform import device
from megatron_gnmr.training.faults import maybe_sigkill

LATEST = "latest"


def checkpoint_root(run_dir: str) -> Path:
    return Path(run_dir) / "checkpoints"


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
        "device": device.rng_state(),
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    device.set_rng_state(state.get("device", {}))


def _rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank_{rank:05d}.pt"


def save_checkpoint(run_dir: str, step: int, shard: dict, meta: dict, keep_last: int) -> Path:
    """Collective: every rank calls it with its own shard."""
    rank = torch.distributed.get_rank()
    root = checkpoint_root(run_dir)
    final = root / f"iter_{step:07d}"
    staging = root / f"iter_{step:07d}.tmp"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    torch.distributed.barrier()
    partial = staging / f".rank_{rank:05d}.pt.partial"
    torch.save(shard, partial)
    os.replace(partial, _rank_file(staging, rank))
    maybe_sigkill(step, "save")  # reliability tests: die with the checkpoint half written
    torch.distributed.barrier()
    if rank == 0:
        meta = dict(meta, step=step, world_size=torch.distributed.get_world_size())
        (staging / "meta.json").write_text(json.dumps(meta, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        _write_atomically(root / LATEST, final.name)
        _prune(root, keep_last)
    torch.distributed.barrier()
    return final


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _prune(root: Path, keep_last: int) -> None:
    complete = sorted(p for p in root.glob("iter_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: str) -> Path | None:
    """The newest complete checkpoint of a run directory, or None if it has none."""
    root = checkpoint_root(run_dir)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    directory = root / pointer.read_text().strip()
    return directory if (directory / "meta.json").is_file() else None


def find_checkpoint(load: str) -> Path:
    """`--load DIR`: a run directory (its latest) or one `iter_*` directory."""
    path = Path(load)
    if (path / "meta.json").is_file():
        return path
    found = latest_checkpoint(load)
    if found is None:
        raise UserError(f"--load {load}: no complete checkpoint there (expected "
                        f"{checkpoint_root(load)}/latest or an iter_* directory with meta.json)")
    return found


def check_compatible(directory: Path, expected: dict) -> dict:
    """Compare a checkpoint's meta with this run's; raise a UserError on any difference."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"--load {directory}: unreadable meta.json ({error})") from None
    for key, value in expected.items():
        found = meta.get(key)
        if found == value:
            continue
        if isinstance(found, dict) and isinstance(value, dict):  # name the field that differs
            field = next(k for k in value if found.get(k) != value.get(k))
            key, found, value = f"{key}.{field}", found.get(field), value.get(field)
        raise UserError(
            f"--load {directory}: the checkpoint has {key} = {_short(found)}, this run has "
            f"{_short(value)}; load it with the same setting or start a new run"
        )
    return meta


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) < 120 else text[:117] + "..."


def load_shard(directory: Path) -> dict:
    rank = torch.distributed.get_rank()
    path = _rank_file(directory, rank)
    if not path.is_file():
        raise UserError(f"--load {directory}: {path.name} is missing (was it written with a "
                        "different number of processes?)")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # truncated or corrupt file: torch raises many types
        raise UserError(f"--load {directory}: {path.name} is corrupt or truncated "
                        f"({type(error).__name__}); load an older checkpoint") from None
