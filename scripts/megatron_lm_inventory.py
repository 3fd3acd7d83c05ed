"""Megatron-LM's command line, read from its own argument parser
(`megatron/training/arguments.py`, `add_megatron_arguments`), into the tables that
`interop/megatron_flags.py` reads:

    python scripts/megatron_lm_inventory.py OUT.json RELEASE=DIR [RELEASE=DIR ...]
        every flag of the releases our users run (megatron_lm_flags.json): its name, how
        many values it takes, its choices, and which releases have it;
    python scripts/megatron_lm_inventory.py --defaults OUT.json TAG=DIR
        what each flag means when it is absent, at the Megatron-LM tag the project pins
        (megatron_lm_defaults.json, core_v0.16.1, the release of the megatron-core we run):
        its destination, its default, and the value a switch stores when given.
        `tests/test_megatron_defaults.py` holds our defaults equal to it.

Each DIR is a Megatron-LM source tree at that release (`git archive TAG megatron | tar -x`),
imported with this interpreter (torch and megatron-core's requirements installed; 0.19.0's
tree needs Python >= 3.12). One module is stood in for, not run: a Triton kernel file that
`megatron.training` imports but the parser never reaches (Triton has no CPU wheel).
"""

import json
import subprocess
import sys

DUMP = r"""
import argparse, enum, importlib.abc, importlib.machinery, json, re, sys
from unittest import mock

TRITON_ONLY = {"megatron.core.transformer.custom_layers.batch_invariant_kernels"}


class StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name in TRITON_ONLY else None

    def create_module(self, spec):
        return mock.MagicMock(name=spec.name)

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, StandIn())
from megatron.training import arguments

parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def plain(value):
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)


out = {}
for action in parser._actions:
    for name in action.option_strings:
        if not name.startswith("--"):
            continue
        out[name] = {"nargs": action.nargs, "takes_value": action.nargs != 0,
                     "choices": [plain(c) for c in action.choices] if action.choices else None,
                     "default": plain(action.default), "dest": action.dest,
                     "action": re.sub(r"(?<!^)(?=[A-Z])", "_", type(action).__name__
                                      .strip("_").replace("Action", "")).lower(),
                     "given": plain(getattr(action, "const", None))}
json.dump(out, sys.stdout)
"""
INVENTORY_KEYS = ("nargs", "takes_value", "choices", "default")
DEFAULTS_KEYS = ("dest", "default", "action", "given")


def parser_of(directory: str) -> dict[str, dict]:
    """Every `--flag` of the parser of the Megatron-LM tree at `directory`."""
    return json.loads(subprocess.run([sys.executable, "-c", DUMP], cwd=directory,
                                     env={"PYTHONPATH": directory}, check=True,
                                     capture_output=True, text=True).stdout)


def write(out: str, table: dict) -> None:
    with open(out, "w") as file:
        json.dump(table, file, indent=0, sort_keys=True)
        file.write("\n")


def main() -> None:
    if sys.argv[1] == "--defaults":
        out, release = sys.argv[2:]
        tag, directory = release.split("=", 1)
        flags = {flag: {key: info[key] for key in DEFAULTS_KEYS}
                 for flag, info in parser_of(directory).items()}
        write(out, {"megatron_lm": tag, "source": "megatron/training/arguments.py",
                    "generated_by": "scripts/megatron_lm_inventory.py --defaults",
                    "flags": flags})
        return
    out, *releases = sys.argv[1:]
    table: dict[str, dict] = {}
    for release in releases:
        name, directory = release.split("=", 1)
        for flag, info in parser_of(directory).items():
            entry = table.setdefault(flag, {**{k: info[k] for k in INVENTORY_KEYS},
                                            "releases": []})
            entry["releases"].append(name)
    write(out, dict(sorted(table.items())))


if __name__ == "__main__":
    main()
