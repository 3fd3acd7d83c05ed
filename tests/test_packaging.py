"""The wheel carries the whole package: every module and every data file the repository has.

The suite runs on an editable install, where a directory without `__init__.py` still imports
(a namespace package) and a data file is read from the working tree; a wheel built from the
same tree silently leaves both out (`find_packages` skips the directory, setuptools skips
files it is not told about), and the installed `megatron-gnmr` then fails on its first
import. So the wheel is built here, from the tracked files alone, and its contents compared
with the tree's.
"""

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tracked_package_files() -> set[str]:
    """Committed or about to be (untracked but not ignored): what the next commit ships."""
    listing = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                              "megatron_gnmr", "setup.py", "pretrain_llama.py"],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout
    return set(listing.split())


def build_wheel(tracked: set[str], tmp_path: Path) -> Path:
    source = tmp_path / "source"
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes((REPO / name).read_bytes())
    # The venv's setuptools, no index: the same build backend a wheelhouse build uses.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(tmp_path / "wheels"), str(source)],
                   check=True, capture_output=True, text=True)
    return next((tmp_path / "wheels").glob("megatron_gnmr-*.whl"))


def test_the_wheel_holds_every_tracked_file_of_the_package(tmp_path):
    tracked = tracked_package_files()
    with zipfile.ZipFile(build_wheel(tracked, tmp_path)) as wheel:
        shipped = {name for name in wheel.namelist() if ".dist-info/" not in name}
    wanted = {name for name in tracked if name != "setup.py"}
    assert wanted - shipped == set(), "tracked, not in the wheel (__init__.py or package_data?)"
    assert shipped - wanted == set(), "in the wheel but not tracked (a build leftover)"


def test_every_package_directory_is_a_regular_package():
    """A directory of modules without `__init__.py` works from the tree and is missing from
    every installed copy; name it here rather than in a user's traceback."""
    for directory in sorted((REPO / "megatron_gnmr").rglob("*")):
        if directory.is_dir() and directory.name != "__pycache__" and any(directory.glob("*.py")):
            assert (directory / "__init__.py").is_file(), f"{directory} has no __init__.py"
