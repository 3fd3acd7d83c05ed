"""Where a run was made: command line, commit, package versions and CPU model, so a committed
summary can be checked by someone who has only the repository."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("torch", "megatron-core", "numpy")


def cpu_name() -> str:
    """The CPU's model name (runs are bitwise reproducible on one CPU only)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def git_commit(repo: Path) -> str | None:
    """HEAD of the checkout the code came from, with `+dirty` when files differ from it."""
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                                  text=True, timeout=30, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    head = git("rev-parse", "HEAD")
    if head is None:
        return None
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "megatron_gnmr",
                "pretrain_llama.py")
    return head + ("+dirty" if dirty else "")


def package_versions() -> dict[str, str | None]:
    versions = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def provenance(repo: Path, command: list[str]) -> dict:
    return {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": command, "commit": git_commit(repo), "packages": package_versions(),
            "cpu": cpu_name()}
