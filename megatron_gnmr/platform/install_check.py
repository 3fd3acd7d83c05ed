"""`python -m megatron_gnmr.platform.install_check`: is megatron-gnmr really installed?

`scripts/setup_env.sh` runs it from outside the repository (`cd /`), so the import below is
the installed package, never the working tree. It checks that the distribution is
installed, that its console scripts exist next to the interpreter (`--bin`), and that every
runtime requirement it declares (markers evaluated, extras left out) imports at a version its
specifier allows, and that every module of the package imports (a module that needs an
extra's distribution which is not installed, `evaluation/lm_eval_model.py` without `[eval]`,
is named with its extra, not counted as broken); it prints each version and exits 1 naming
every problem.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import pkgutil
import re
import sys
from pathlib import Path

DISTRIBUTION = "megatron-gnmr"


def _requirement_type():
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip always carries it
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def _module_names() -> dict[str, list[str]]:
    """distribution (canonical name) -> its top-level modules."""
    out: dict[str, list[str]] = {}
    for module, distributions in metadata.packages_distributions().items():
        for name in distributions:
            out.setdefault(_canonical(name), []).append(module)
    return out


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


# A distribution whose import name its metadata does not give away (namespace packages).
IMPORT_NAMES = {"megatron-core": "megatron.core"}


def problems(distribution: str = DISTRIBUTION, bin_dir: Path | None = None,
             report=print) -> list[str]:
    found = []
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return [f"{distribution} is not installed in {sys.prefix}"]
    report(f"install check: {distribution} {dist.version} ({sys.prefix})")
    if bin_dir is not None:
        for entry in dist.entry_points:
            if entry.group == "console_scripts" and not (bin_dir / entry.name).is_file():
                found.append(f"console script {entry.name} missing from {bin_dir}")
    Requirement = _requirement_type()
    modules = _module_names()
    for text in dist.requires or []:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # an extra's, or another Python's
        name = _canonical(requirement.name)
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            found.append(f"{requirement.name} ({requirement}) is not installed")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            found.append(f"{requirement.name} {version} is installed, {requirement} required")
        module = IMPORT_NAMES.get(name) or next(iter(sorted(modules.get(name, []))), None)
        try:
            if module is not None:
                importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 (any import failure is the finding)
            found.append(f"{requirement.name} {version} does not import ({module}: {error})")
            continue
        report(f"install check:   {requirement.name} {version}")
    module = importlib.import_module("megatron_gnmr")
    report(f"install check:   megatron_gnmr imported from {Path(module.__file__).parent}")
    found += _unimportable_modules(module, extras_distributions(dist.requires or []), report)
    return found


def extras_distributions(requires: list[str]) -> dict[str, str]:
    """The distributions only an extra brings (canonical name -> the extra to name: the
    smallest one holding it, `eval` rather than `dev` for lm-eval), from the `Requires-Dist`
    lines; one also required outright is not among them."""
    Requirement = _requirement_type()
    always, extras = set(), {}
    for text in requires:
        requirement = Requirement(text)
        name = _canonical(requirement.name)
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", str(requirement.marker or ""))
        if extra:
            extras.setdefault(extra.group(1), set()).add(name)
        elif requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            always.add(name)
    optional = {}
    for extra, names in sorted(extras.items(), key=lambda item: (-len(item[1]), item[0])):
        optional.update({name: extra for name in names - always})
    return optional


def _unimportable_modules(package, optional: dict[str, str], report=print) -> list[str]:
    """Every module of the installed package imports (a subpackage or data file left out of
    the wheel shows here, not in a user's first command). Optional backends are import-guarded
    inside them (nothing needs TE, torchao or transformers to import); the few modules built on
    an extra's library (`optional`: distribution -> extra) are reported, not failed, when that
    library is missing."""
    found = []
    for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
        try:
            importlib.import_module(module.name)
        except ModuleNotFoundError as error:
            missing = _canonical((error.name or "").split(".")[0])
            if missing in optional:
                report(f"install check:   {module.name} needs the extra "
                       f"[{optional[missing]}] ({missing} is not installed)")
                continue
            found.append(f"{module.name} does not import from the installed package ({error!r})")
        except Exception as error:  # noqa: BLE001 (any import failure is the finding)
            found.append(f"{module.name} does not import from the installed package ({error!r})")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin", type=Path, default=None,
                        help="the environment's bin directory (console scripts are checked)")
    parser.add_argument("--distribution", default=DISTRIBUTION)
    args = parser.parse_args(argv)
    found = problems(args.distribution, args.bin)
    for problem in found:
        print(f"install check: PROBLEM: {problem}", file=sys.stderr)
    if found:
        return 1
    from megatron_gnmr.platform import capabilities

    for name, capability in capabilities.report():
        print(f"install check: {name}: {'yes' if capability else 'no'} ({capability.reason})")
    print("install check: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
