"""The torch format's checkpoints on disk: either complete or invisible, hold data and never
code, and are never lost to a later run.

Layout: `<dir>/checkpoints/iter_0000100/{rank_00000.pt, ..., meta.json}` and
`<dir>/checkpoints/latest` naming the newest complete one. Every rank writes its own shard
(model, optimizer, scheduler, RNG, data position, controller and monitor state, as plain
data: `safe_state.py`) into `iter_*.tmp/` under a temporary name, fsyncs it and records its
size and sha256; rank 0 writes `meta.json` (the shards' sizes and hashes, the settings a
resume depends on), renames the directory, replaces `latest` (write, fsync, rename) and only
then prunes: complete checkpoints OLDER than the one just written (by parsed step number),
beyond `--keep-last`. A kill at any moment leaves the previous checkpoint and `latest`
intact.

Loading: rank 0 lists the candidates (the one `latest` names, then the others, newest
first; `latest` is accepted only if it names an `iter_<step>` directory inside the run),
skips any whose meta.json or shard sizes are wrong, and broadcasts its choice; every rank
checks its shard's sha256, and a candidate any rank finds corrupt is passed over (with a
warning) for the next intact one. Shards are read with `torch.load(weights_only=True)`.

`--ckpt-format torch`, beside the default torch_dist (megatron-core's `dist_checkpointing`,
`torch_dist/`, which reshards across layouts): a per-rank shard is exact for the layout that
wrote it and is refused on another (checked on load); LoRA's adapters-only checkpoints and
merge-lora use it. Which of the two a caller is dealing with, it asks `formats.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch

from megatron_gnmr.checkpoints.durable import fsync_directory, write_durably
from megatron_gnmr.checkpoints.safe_state import from_plain, to_plain
from megatron_gnmr.errors import UserError
from megatron_gnmr.platform import device_audit

LATEST = "latest"
FORMAT = 2  # meta.json format: shard hashes and the resume settings
ITERATION = re.compile(r"iter_(\d{7,})")


def checkpoint_root(run_dir: str) -> Path:
    return Path(run_dir) / "checkpoints"


def _rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank_{rank:05d}.pt"


def step_of(path: Path) -> int | None:
    match = ITERATION.fullmatch(path.name)
    return int(match.group(1)) if match else None


# -- writing ---------------------------------------------------------------------------
class _HashingWriter:
    """A file that hashes what torch.save writes into it (no second read of the shard)."""

    def __init__(self, file):
        self.file, self.sha256, self.size = file, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _write_shard(staging: Path, rank: int, shard: dict) -> dict:
    partial = staging / f".rank_{rank:05d}.pt.partial"
    with open(partial, "wb") as file:
        writer = _HashingWriter(file)
        torch.save(to_plain(shard), writer)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, _rank_file(staging, rank))
    return {"file": _rank_file(staging, rank).name, "size": writer.size,
            "sha256": writer.sha256.hexdigest()}


def save_checkpoint(run_dir: str, step: int, shard: dict, meta: dict, keep_last: int,
                    faults=None) -> Path:
    """Collective: every rank calls it with its own shard (`faults`: the trainer's
    `FaultHooks`, for the reliability tests)."""
    rank = torch.distributed.get_rank()
    root = checkpoint_root(run_dir)
    final = root / f"iter_{step:07d}"
    staging = root / f"iter_{step:07d}.tmp"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    torch.distributed.barrier()
    record = _write_shard(staging, rank, shard)
    if faults is not None:  # reliability tests: die with the checkpoint half written
        faults.maybe_kill(step, "save")
    records = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(records, record)
    if rank == 0:
        meta = dict(meta, format=FORMAT, step=step,
                    world_size=torch.distributed.get_world_size(),
                    shards={r["file"]: {"size": r["size"], "sha256": r["sha256"]}
                            for r in records})
        write_durably(staging / "meta.json", json.dumps(meta, indent=2))
        fsync_directory(staging)
        if final.exists():  # the same step written again: the new one replaces it
            shutil.rmtree(final)
        os.replace(staging, final)
        fsync_directory(root)
        write_durably(root / LATEST, final.name)
        _prune_older(root, step, keep_last)
    torch.distributed.barrier()
    return final


def write_checkpoint(run_dir: str, step: int, shards: list[dict], meta: dict) -> Path:
    """One process writes every rank's shard (tools such as merge-lora), in the same
    complete-or-invisible way as `save_checkpoint`."""
    root = checkpoint_root(run_dir)
    final, staging = root / f"iter_{step:07d}", root / f"iter_{step:07d}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    records = [_write_shard(staging, rank, shard) for rank, shard in enumerate(shards)]
    meta = dict(meta, format=FORMAT, step=step, world_size=len(shards),
                shards={r["file"]: {"size": r["size"], "sha256": r["sha256"]} for r in records})
    write_durably(staging / "meta.json", json.dumps(meta, indent=2))
    fsync_directory(staging)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    write_durably(root / LATEST, final.name)
    return final


def read_shard(directory: Path, rank: int) -> dict:
    """Rank `rank`'s shard, hash-checked against meta.json (tools reading every shard)."""
    if not shard_matches(directory, rank):
        raise UserError(f"{directory}: {_rank_file(directory, rank).name} is missing or its "
                        "sha256 differs from meta.json (corrupt)")
    return from_plain(torch.load(_rank_file(directory, rank), map_location="cpu",
                                 weights_only=True))


def _prune_older(root: Path, step: int, keep_last: int) -> None:
    """Delete complete checkpoints older than `step` beyond the newest `keep_last` (counting
    the one at `step`). Newer ones (another run's, kept by --load) are never touched."""
    older = sorted((s, p) for p in root.iterdir() if p.is_dir() and (s := step_of(p)) is not None
                   and s < step and (p / "meta.json").is_file())
    for _, path in older[: max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(path, ignore_errors=True)


# -- reading ---------------------------------------------------------------------------
def latest_checkpoint(run_dir: str) -> Path | None:
    """The checkpoint `latest` names, if that is an `iter_<step>` directory inside the run
    with a meta.json; None otherwise."""
    root = checkpoint_root(run_dir)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not ITERATION.fullmatch(name):
        return None
    directory = root / name
    return directory if (directory / "meta.json").is_file() else None


def checkpoint_steps(run_dir: str) -> list[int]:
    """Steps of every complete checkpoint of a run directory (the reuse check)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(s for p in root.iterdir() if (s := step_of(p)) is not None
                  and (p / "meta.json").is_file())


def read_meta(directory: Path) -> dict:
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"--load {directory}: unreadable meta.json ({type(error).__name__})") \
            from None
    if not isinstance(meta, dict):
        raise UserError(f"--load {directory}: meta.json is not a checkpoint description")
    return meta


def intact_on_disk(directory: Path) -> str | None:
    """Why `directory` cannot be loaded (meta or shard sizes), or None."""
    try:
        meta = read_meta(directory)
    except UserError as error:
        return str(error).split(": ", 1)[1]
    if meta.get("format") != FORMAT or not isinstance(meta.get("shards"), dict):
        return (f"written by another version of megatron-gnmr (format {meta.get('format')}, "
                f"this one reads {FORMAT})")
    for name, expected in meta["shards"].items():
        path = directory / name
        if not re.fullmatch(r"rank_\d{5}\.pt", name) or not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected.get("size"):
            return f"{name} is truncated or corrupt (size {path.stat().st_size}, meta.json " \
                   f"says {expected.get('size')})"
    return None


def newest_intact(run_dir: str) -> Path | None:
    """The newest checkpoint of a run whose meta.json and shard sizes are right (tools that
    read it offline check the shards' hashes as they read them)."""
    return next((c for c in candidates(run_dir) if intact_on_disk(c) is None), None)


def candidates(load: str) -> list[Path]:
    """What `--load`/`--resume auto` may load, in order: an `iter_*` directory given
    directly; else the one `latest` names, then every other checkpoint newest first."""
    path = Path(load)
    if (path / "meta.json").is_file():
        return [path]
    root = checkpoint_root(load)
    found = sorted((p for p in root.iterdir() if p.is_dir() and step_of(p) is not None),
                   key=step_of, reverse=True) if root.is_dir() else []
    latest = latest_checkpoint(load)
    return ([latest] if latest else []) + [p for p in found if p != latest]


def shard_matches(directory: Path, rank: int) -> int:
    path = _rank_file(directory, rank)
    expected = read_meta(directory)["shards"].get(path.name, {})
    sha256 = hashlib.sha256()
    try:
        with open(path, "rb") as file:
            for block in iter(lambda: file.read(1 << 24), b""):
                sha256.update(block)
    except OSError:
        return 0
    return int(sha256.hexdigest() == expected.get("sha256"))


def load_shard(directory: Path) -> dict:
    """This rank's shard, as data (`weights_only=True`: a crafted file cannot run code)."""
    path = _rank_file(directory, torch.distributed.get_rank())
    if not path.is_file():
        raise UserError(f"--load {directory}: {path.name} is missing (was it written with a "
                        "different number of processes?)")
    try:
        shard = from_plain(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as error:  # truncated, corrupt or not data-only: torch raises many types
        raise UserError(f"--load {directory}: {path.name} cannot be read as a checkpoint "
                        f"({type(error).__name__}); load an older checkpoint") from None
    device_audit.mark_restored(shard)  # read to the host: it must move to the run's device
    return shard
