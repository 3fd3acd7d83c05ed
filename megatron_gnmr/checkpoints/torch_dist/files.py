"""The torch_dist checkpoint on disk: Megatron-LM's layout, complete or invisible.

Layout (Megatron-LM's, so its loader finds it): `<save>/iter_0000100/` holding megatron-core's
`dist_checkpointing` files (`.metadata`, `__<rank>_<n>.distcp`, `metadata.json`, `common.pt` up to 0.16)
and ours, `megatron_gnmr.json` (the size and sha256 of every file, the layout it was written
in, the settings a resume checks); `<save>/latest_checkpointed_iteration.txt` names the newest.

Writing: every rank writes its part into `iter_0000100.tmp/` (megatron-core writes each tensor
once, by one replica); the files are hashed (an async save's writer processes hash the files
they wrote, off the training thread; the rest is split over the ranks), rank 0 writes
`megatron_gnmr.json` durably, renames the directory, replaces the tracker file (write, fsync,
rename) and only then prunes older checkpoints beyond `--keep-last`. A kill at any moment
leaves the previous checkpoint and the tracker intact; a directory without
`megatron_gnmr.json` is never loaded.

A preemption's save has a window (torchrun's SIGKILL follows its SIGTERM after 30 s by
default), so it publishes first and hashes after (`finish_then_hash`): its files are written
and fsynced before the rename, the manifest records their sizes and says the hashes are
pending, the tracker points to it, and then every file is read back, hashed and recorded, and
only then are older checkpoints pruned. A resume that finds the hashes still pending (the
SIGKILL came first) loads it on its sizes with a warning, never silently.

Choosing: the tracker's iteration first, then the others newest first; rank 0 passes over
any whose files are missing or of the wrong size, the ranks together check every file's
sha256 (file i on rank i mod world), and a candidate any rank finds corrupt is passed over,
with a warning, for the next intact one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import torch

from megatron_gnmr.checkpoints.durable import fsync_directory, write_durably
from megatron_gnmr.errors import UserError
from megatron_gnmr.platform.device import run_device

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's name
MANIFEST = "megatron_gnmr.json"
FORMAT = 1
ITERATION = re.compile(r"iter_(\d{7,})")
WRITER_HASHES = "megatron_gnmr.writer_sha256.rank"  # + "<rank>.json", removed before publication
PENDING = "sha256_pending"  # a manifest published before its files were hashed


def step_of(path: Path) -> int | None:
    match = ITERATION.fullmatch(path.name)
    return int(match.group(1)) if match else None


def is_complete(directory: Path) -> bool:
    return (directory / MANIFEST).is_file()


def staging_directory(root: str, step: int) -> Path:
    """Rank 0 calls it (a fresh `iter_*.tmp`); the others wait at a barrier after."""
    staging = Path(root) / f"iter_{step:07d}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _my_files(names: list[str]) -> list[str]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return [name for i, name in enumerate(sorted(names)) if i % world == rank]


def _record(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def record_writer_hashes(staging: Path, rank: int, paths: list[str]) -> None:
    """In an async save's writer process, once its files are written and fsynced: their size
    and sha256, for `finish` to take instead of reading them again on the training thread."""
    records = {Path(path).name: _record(Path(path)) for path in paths}
    (staging / f"{WRITER_HASHES}{rank}.json").write_text(json.dumps(records))


def _writer_hashes(staging: Path) -> dict:
    """This rank's writer's records (none if it wrote nothing or died before recording)."""
    note = staging / f"{WRITER_HASHES}{torch.distributed.get_rank()}.json"
    try:
        return json.loads(note.read_text())
    except (OSError, ValueError):
        return {}


def _written_files(staging: Path) -> list[str]:
    return sorted(p.name for p in staging.iterdir()
                  if p.is_file() and not p.name.startswith(WRITER_HASHES))


def _gathered(part: dict) -> dict:
    """Collective: every rank's `part`, merged."""
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, part)
    return {name: record for each in parts for name, record in each.items()}


def _publish(root: str, staging: Path, step: int, manifest: dict) -> Path:
    """Rank 0: the manifest written durably, the directory renamed, the tracker replaced."""
    final = Path(root) / f"iter_{step:07d}"
    for note in staging.glob(f"{WRITER_HASHES}*"):
        note.unlink()
    write_durably(staging / MANIFEST, json.dumps(manifest, indent=2))
    fsync_directory(staging)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    fsync_directory(final.parent)
    write_durably(Path(root) / TRACKER, str(step))
    return final


def finish(root: str, staging: Path, step: int, manifest: dict, keep_last: int) -> Path:
    """Collective, after every rank wrote its part into `staging`: hash, describe, publish,
    prune. Returns the final directory."""
    names = _written_files(staging)
    hashed = {name: record for name, record in _gathered(_writer_hashes(staging)).items()
              if name in names and (staging / name).stat().st_size == record["size"]}
    rest = [name for name in names if name not in hashed]
    files = {**hashed, **_gathered({name: _record(staging / name) for name in _my_files(rest)})}
    final = Path(root) / f"iter_{step:07d}"
    if torch.distributed.get_rank() == 0:
        _publish(root, staging, step, {**manifest, "format": FORMAT, "step": step,
                                       "files": files})
        _prune_older(Path(root), step, keep_last)
    torch.distributed.barrier()
    return final


def _synced_size(path: Path) -> int:
    """The file's size once it is on disk (megatron's writer fsyncs the tensor files; its
    small files, `common.pt` and `metadata.json`, it does not)."""
    with open(path, "rb") as file:
        os.fsync(file.fileno())
        return os.fstat(file.fileno()).st_size


def finish_then_hash(root: str, staging: Path, step: int, manifest: dict, keep_last: int,
                     on_published: Callable[[Path], None]) -> Path:
    """Collective, as `finish`, for a save that must fit a window: published with its sizes
    (its hashes pending; `on_published(path)` then), then every file read back and hashed
    (split over the ranks) and the manifest rewritten with the hashes and the published sizes
    (a file changed since fails the size check of any load); older checkpoints are pruned only
    then. Returns the final directory."""
    names = _written_files(staging)
    sizes = _gathered({name: {"size": _synced_size(staging / name)} for name in _my_files(names)})
    described = {**manifest, "format": FORMAT, "step": step}
    final = Path(root) / f"iter_{step:07d}"
    if torch.distributed.get_rank() == 0:
        _publish(root, staging, step, {**described, "files": sizes, PENDING: True})
    torch.distributed.barrier()
    on_published(final)
    files = _gathered({name: {**sizes[name], "sha256": _sha256(final / name)}
                       for name in _my_files(names)})
    if torch.distributed.get_rank() == 0:
        write_durably(final / MANIFEST, json.dumps(
            {**described, "files": files, "hashed_after_publication": True}, indent=2))
        _prune_older(Path(root), step, keep_last)
    torch.distributed.barrier()
    return final


def _prune_older(root: Path, step: int, keep_last: int) -> None:
    older = sorted((s, p) for p in root.iterdir() if p.is_dir()
                   and (s := step_of(p)) is not None and s < step and is_complete(p))
    for _, path in older[: max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(path, ignore_errors=True)


def checkpoint_steps(run_dir: str) -> list[int]:
    root = Path(run_dir)
    if not root.is_dir():
        return []
    return sorted(s for p in root.iterdir() if (s := step_of(p)) is not None
                  and is_complete(p))


def latest(run_dir: str) -> Path | None:
    """The checkpoint the tracker names, if complete."""
    tracker = Path(run_dir) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        return None
    directory = Path(run_dir) / f"iter_{int(text):07d}"
    return directory if is_complete(directory) else None


def candidates(load: str) -> list[Path]:
    """An `iter_*` directory given directly; else the tracker's, then the others newest
    first."""
    path = Path(load)
    if is_complete(path):
        return [path]
    found = sorted((p for p in path.iterdir() if p.is_dir() and step_of(p) is not None
                    and is_complete(p)), key=step_of, reverse=True) if path.is_dir() else []
    pointed = latest(load)
    return ([pointed] if pointed else []) + [p for p in found if p != pointed]


def read_manifest(directory: Path) -> dict:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"--load {directory}: unreadable {MANIFEST} "
                        f"({type(error).__name__})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise UserError(f"--load {directory}: {MANIFEST} is not a checkpoint description")
    return manifest


def problem_on_disk(directory: Path) -> str | None:
    """Why `directory` cannot be loaded (manifest, a file missing or of another size)."""
    try:
        manifest = read_manifest(directory)
    except UserError as error:
        return str(error).split(": ", 1)[1]
    if manifest.get("format") != FORMAT:
        return f"written by another version of megatron-gnmr (format {manifest.get('format')})"
    for name, record in manifest["files"].items():
        path = directory / name
        if "/" in name or not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != record.get("size"):
            return f"{name} is truncated or corrupt (size {path.stat().st_size}, the manifest " \
                   f"says {record.get('size')})"
    return None


def hashes_pending(directory: Path) -> str | None:
    """Why `directory` cannot be checked by its hashes: a preemption's save published it and
    was stopped before it had hashed its files (None: the hashes are there)."""
    if not read_manifest(directory).get(PENDING):
        return None
    return (f"{directory} was published by a preemption's save that was stopped before it "
            "had hashed its files: loaded on its sizes alone (every file was written and "
            "fsynced before it was published)")


def hashes_match(directory: Path) -> bool:
    """Collective: every file's sha256 against the manifest (the files split over ranks);
    true without reading where the hashes are pending (`hashes_pending` says so)."""
    manifest = read_manifest(directory)
    if manifest.get(PENDING):  # every rank reads the same manifest: every rank returns here
        return True
    files = manifest["files"]
    good = all(_sha256(directory / name) == files[name]["sha256"]
               for name in _my_files(list(files)))
    verdict = torch.tensor([int(good)], device=run_device())
    torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MIN)
    return bool(verdict.item())
