"""Collect everything an offline machine needs to install and run megatron-gnmr: a wheelhouse.

Run it on a machine that reaches the package registries, with the project installed
(`.venv/bin/python scripts/wheelhouse.py DIR`), for the target's Python and platform:

    .venv/bin/python scripts/wheelhouse.py /path/wheelhouse --python-version 3.12 \\
        --platform manylinux [--extras dev] [--with-torch] [--target-has FILE]

(`--platform manylinux`: the x86_64 manylinux tags of a current cluster, glibc 2.17 to 2.28;
or give wheel platform tags one by one.) The project's own requirement markers are evaluated
for the target's Python; its dependencies' markers are pip's, for the Python running this
script, so building with the target's Python is exact.

DIR/wheels holds the project's wheel and every wheel its requirements resolve to for that
target (pip's own resolver, `pip install --dry-run --report`, binary wheels only); torch and
what only torch needs (triton, the nvidia-* CUDA libraries, sympy, ...) are left out unless
`--with-torch`, since a GPU cluster brings its own torch (an NGC container). Transformer Engine
cannot travel as wheels and `--with-te` is refused (`TE_REFUSAL`): it comes with the target's
container, or is built there. `--target-has FILE` leaves out what the target's python already
holds (FILE: `python -m pip list --format=freeze` run there; a bare name is taken at whatever
version it has there): a pinned line constrains the resolution to that version, so what is
carried agrees with it, and the setup there (a venv that sees the container's packages) uses
the container's copy. DIR/data holds the pinned corpus archives `prepare-data` reads
(Shakespeare, Austen), DIR/manifest.json every file's sha256 and size. On the offline machine:

    WHEELHOUSE=/path/wheelhouse bash scripts/setup_env.sh
    WHEELHOUSE=/path/wheelhouse .venv/bin/megatron-gnmr prepare-data
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT = "megatron-gnmr"
# What a GPU box's own torch brings: left out with torch unless another requirement needs it.
TORCH_ROOTS = ("torch",)
# Why no wheelhouse can carry Transformer Engine, and what can. PyPI (2026-12): every file of
# transformer-engine-torch (1.9 to 2.20.2) is an sdist; the core wheels (x86_64) of 2.9 / 2.11
# / 2.18 / 2.20.2 are 186 / 179 / 279 / 277 MB for cu13 and 304 / 288 / 503 / 729 MB for cu12.
TE_REFUSAL = ("wheelhouse: {flag} is refused: Transformer Engine cannot be carried as wheels "
              "(transformer-engine-torch has no binary wheel at any release 2.9-2.20: it "
              "compiles against the target's own torch at install; the core wheel alone is "
              "179-279 MB for CUDA 13, 288-729 MB for CUDA 12); get it on the target: run in "
              "an NGC PyTorch container, which ships it (scripts/setup_env.sh keeps the "
              "container's), or build it there (pip install --no-build-isolation "
              "'transformer-engine[pytorch]', with the CUDA toolkit and the torch it will run "
              "with), then build this wheelhouse without it")
MANYLINUX_X86_64 = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64")


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _packaging():
    try:
        from packaging.markers import Marker  # noqa: F401
        from packaging.requirements import Requirement
    except ImportError:  # pip always carries it
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def _extras(args) -> set[str]:
    return {e for e in args.extras.split(",") if e}


def te_refusal(args) -> str | None:
    """The one-line refusal for a wheelhouse asked to carry Transformer Engine, else None."""
    if args.with_te:
        return TE_REFUSAL.format(flag="--with-te")
    if "te" in _extras(args):
        return TE_REFUSAL.format(flag="--extras te")
    return None


def project_requirements(project_wheel: Path, args) -> list[str]:
    """The project's requirements for the target, markers evaluated for the TARGET's Python
    (pip evaluates markers for the interpreter it runs on, whatever --python-version says:
    from 3.11, our `python_version >= '3.12'` megatron-core line would never apply)."""
    import zipfile

    Requirement = _packaging()
    with zipfile.ZipFile(project_wheel) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        lines = wheel.read(name).decode().splitlines()
    environment = _environment({"environment": _host_environment()}, args)
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist: "):
            continue
        requirement = Requirement(line[len("Requires-Dist: "):])
        marker, requirement.marker = requirement.marker, None
        if marker is None or any(marker.evaluate({**environment, "extra": extra})
                                 for extra in _extras(args) | {""}):
            out.append(str(requirement))
    return out


def _host_environment() -> dict:
    try:
        from packaging.markers import default_environment
    except ImportError:
        from pip._vendor.packaging.markers import default_environment
    return default_environment()


def resolve(project_wheel: Path, args, work: Path) -> dict:
    """pip's resolution of the project's requirements for the target: the install report."""
    requirements = project_requirements(project_wheel, args)
    report = work / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
               "--quiet", "--report", str(report), "--only-binary=:all:", *requirements]
    pins = [f"{name}=={version}" for name, version in args.target_has.items() if version]
    if pins:
        constraints = work / "target-constraints.txt"
        constraints.write_text("\n".join(pins) + "\n")
        command += ["-c", str(constraints)]
    if args.python_version or args.platform:
        command += ["--target", str(work / "unused"), "--implementation", "cp",
                    "--python-version", args.python_version or
                    f"{sys.version_info.major}.{sys.version_info.minor}"]
        for platform in args.platform or []:
            command += ["--platform", platform]
    print(f"wheelhouse: resolving {len(requirements)} requirements for Python "
          f"{args.python_version or sys.version.split()[0]} "
          f"{' '.join(args.platform or ['(this platform)'])}")
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"wheelhouse: pip could not resolve the requirements:\n{result.stderr}")
    return json.loads(report.read_text())


def _environment(report: dict, args) -> dict:
    environment = dict(report["environment"])
    if args.python_version:
        environment["python_version"] = args.python_version
        environment["python_full_version"] = f"{args.python_version}.0"
    if args.platform:
        tag = args.platform[0]
        machine = next((m for m in ("x86_64", "aarch64") if m in tag),
                       environment.get("platform_machine"))
        environment.update(sys_platform="linux", platform_system="Linux",
                           platform_machine=machine)
    return environment


def kept_packages(report: dict, args) -> tuple[list[dict], list[str]]:
    """The report's packages reachable from the project without passing through torch, unless
    asked for; and the names left out."""
    Requirement = _packaging()
    environment = _environment(report, args)
    packages = {_canonical(p["metadata"]["name"]): p for p in report["install"]}
    excluded_roots = set() if args.with_torch else set(TORCH_ROOTS)
    reached, queue = set(), [(name, frozenset(p.get("requested_extras") or ()))
                             for name, p in packages.items() if p.get("requested")]
    while queue:
        name, wanted = queue.pop()
        if name in excluded_roots or name not in packages or (name, wanted) in reached:
            continue
        reached.add((name, wanted))
        for text in packages[name]["metadata"].get("requires_dist", []):
            requirement = Requirement(text)
            marker = requirement.marker
            applies = marker is None or any(
                marker.evaluate({**environment, "extra": extra}) for extra in (wanted or {""}))
            if applies:
                queue.append((_canonical(requirement.name), frozenset(requirement.extras)))
    names = {name for name, _ in reached} - set(args.target_has)
    kept = [p for name, p in packages.items() if name in names]
    return kept, sorted(set(packages) - names)


def target_packages(path: str | None) -> dict[str, str | None]:
    """The target python's packages (canonical name -> version, None for a bare name), from
    a `pip list --format=freeze` file; editable and URL lines name no wheel and are skipped."""
    if path is None:
        return {}
    file = Path(path)
    if not file.is_file():
        sys.exit(f"wheelhouse: --target-has {path}: no such file")
    out: dict[str, str | None] = {}
    for number, raw in enumerate(file.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-e") or " @ " in line:
            continue
        name, pinned, version = line.partition("==")
        if not name.replace("-", "").replace("_", "").replace(".", "").isalnum() or \
                (pinned and not version.strip()):
            sys.exit(f"wheelhouse: --target-has {path}:{number}: {raw!r} is not NAME or "
                     "NAME==VERSION (pip list --format=freeze)")
        out[_canonical(name.strip())] = version.strip() or None
    return out


def _download(url: str, target: Path, sha256: str | None) -> None:
    with urllib.request.urlopen(url, timeout=300) as response, target.open("wb") as out:
        shutil.copyfileobj(response, out)
    if sha256 and hashlib.sha256(target.read_bytes()).hexdigest() != sha256:
        target.unlink()
        sys.exit(f"wheelhouse: {target.name} from {url} does not match its sha256")


def collect_wheels(kept: list[dict], wheels: Path) -> None:
    for package in kept:
        info = package["download_info"]
        name = info["url"].rsplit("/", 1)[-1]
        target = wheels / name
        sha256 = info.get("archive_info", {}).get("hashes", {}).get("sha256")
        if target.is_file() and (not sha256 or
                                 hashlib.sha256(target.read_bytes()).hexdigest() == sha256):
            continue
        print(f"wheelhouse:   {name}")
        _download(info["url"], target, sha256)


def collect_data(data: Path) -> None:
    """The pinned corpus archives prepare-data reads, checked against their sha256."""
    from megatron_gnmr.data import austen, corpus

    for url, sha256 in ((corpus.SHAKESPEARE_URL, corpus.SHAKESPEARE_SHA256),
                        (austen.AUSTEN_URL, austen.AUSTEN_SHA256)):
        target = data / url.rsplit("/", 1)[-1]
        if not target.is_file():
            _download(url, target, sha256)


def write_manifest(root: Path, args, excluded: list[str]) -> dict:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "manifest.json")
    entries = [{"path": str(p.relative_to(root)), "size": p.stat().st_size,
                "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in files]
    manifest = {"project": PROJECT, "python_version": args.python_version or
                f"{sys.version_info.major}.{sys.version_info.minor}",
                "platform": args.platform or "the building machine's",
                "extras": args.extras, "with_torch": args.with_torch,
                "left_out": excluded, "on_target": sorted(args.target_has), "files": entries,
                "total_bytes": sum(e["size"] for e in entries)}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="the wheelhouse directory (created; reused if present)")
    parser.add_argument("--python-version", default=None, help="the target's Python, e.g. "
                        "3.12 (default: this interpreter's)")
    parser.add_argument("--platform", action="append", default=None, help="a wheel platform "
                        "tag of the target, e.g. manylinux_2_28_x86_64 (repeatable; default: "
                        "this machine's)")
    parser.add_argument("--extras", default="", help="the project's extras, e.g. dev")
    parser.add_argument("--with-torch", action="store_true", help="include torch and its "
                        "dependencies (a machine that brings no torch of its own)")
    parser.add_argument("--with-te", action="store_true", help="refused, with the reason and "
                        "the routes to Transformer Engine on the target")
    parser.add_argument("--no-data", action="store_true", help="leave out the corpora")
    parser.add_argument("--target-has", metavar="FILE", default=None, help="the target "
                        "python's `pip list --format=freeze`: those packages are left out "
                        "(pinned ones constrain the resolution)")
    args = parser.parse_args()
    if te_refusal(args):
        sys.exit(te_refusal(args))
    args.target_has = target_packages(args.target_has)
    if args.platform and "manylinux" in args.platform:
        args.platform = [t for t in args.platform if t != "manylinux"] + list(MANYLINUX_X86_64)
    root = Path(args.dir).resolve()
    wheels, data = root / "wheels", root / "data"
    wheels.mkdir(parents=True, exist_ok=True)
    for old in wheels.glob("megatron_gnmr-*.whl"):
        old.unlink()
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                            "-w", str(wheels), str(REPO)], capture_output=True, text=True)
    if build.returncode != 0:
        sys.exit(f"wheelhouse: building the project's wheel failed:\n{build.stderr}")
    project_wheel = next(wheels.glob("megatron_gnmr-*.whl"))
    with tempfile.TemporaryDirectory() as work:
        report = resolve(project_wheel, args, Path(work))
    kept, excluded = kept_packages(report, args)
    print(f"wheelhouse: {len(kept)} packages; left out ({len(excluded)}): "
          f"{', '.join(excluded) or 'none'}")
    collect_wheels(kept, wheels)
    if not args.no_data:
        data.mkdir(exist_ok=True)
        collect_data(data)
    manifest = write_manifest(root, args, excluded)
    wheel_bytes = sum(e["size"] for e in manifest["files"] if e["path"].startswith("wheels/"))
    print(f"wheelhouse: {root}: {manifest['total_bytes'] / 2**20:.1f} MiB "
          f"({wheel_bytes / 2**20:.1f} MiB of wheels, {len(manifest['files'])} files)")


if __name__ == "__main__":
    main()
