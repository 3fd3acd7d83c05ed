"""Writing that survives a crash at any instant: write-then-rename, with the file and the
directory that holds it fsynced (both formats publish their descriptions and pointers this
way: a reader sees the old file or the new one, never half of one)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_directory(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_durably(path: Path, text: str) -> None:
    """Write-then-rename, with the file and its directory fsynced."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
    fsync_directory(path.parent)
