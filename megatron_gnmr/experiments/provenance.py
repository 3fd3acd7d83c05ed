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
    """The CPU's model name with its family, model and stepping (runs are bitwise
    reproducible on one CPU model only, and a name such as "AMD EPYC" covers several)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    fields = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    ids = [f"{label} {fields[key]}" for key, label in
           (("cpu family", "family"), ("model", "model"), ("stepping", "stepping"))
           if fields.get(key)]
    return f"{name} ({', '.join(ids)})" if ids else name


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
