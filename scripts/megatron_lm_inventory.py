"""Regenerate megatron_gnmr/interop/megatron_lm_flags.json: every flag Megatron-LM's
`pretrain_gpt.py` accepts, read from Megatron-LM's own argument parser at the releases our
users run, so the flag table (`interop/megatron_flags.py`) knows each flag and how many
values it takes.

    python scripts/megatron_lm_inventory.py OUT.json RELEASE=DIR [RELEASE=DIR ...]

Each DIR is a Megatron-LM source tree at that release (its `megatron/` importable, with
megatron-core's requirements and `six`/`regex` installed). Only the interface is kept: names,
how many values, choices, default, and which releases have the flag.
"""

import json
import subprocess
import sys

DUMP = r"""
import argparse, json, sys
from megatron.training import arguments
parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
out = {}
for action in parser._actions:
    for name in action.option_strings:
        if not name.startswith("--"):
            continue
        plain = lambda v: v if isinstance(v, (int, float, str, bool, type(None))) else None
        out[name] = {"nargs": action.nargs, "takes_value": action.nargs != 0,
                     "choices": [plain(c) for c in action.choices] if action.choices else None,
                     "default": plain(action.default) if not isinstance(action.default, list)
                     else [plain(v) for v in action.default]}
json.dump(out, sys.stdout)
"""


def main() -> None:
    out, *releases = sys.argv[1:]
    table: dict[str, dict] = {}
    for release in releases:
        name, directory = release.split("=", 1)
        flags = json.loads(subprocess.run([sys.executable, "-c", DUMP], cwd=directory,
                                          env={"PYTHONPATH": directory}, check=True,
                                          capture_output=True, text=True).stdout)
        for flag, info in flags.items():
            table.setdefault(flag, {**info, "releases": []})["releases"].append(name)
    with open(out, "w") as file:
        json.dump(dict(sorted(table.items())), file, indent=0, sort_keys=True)
        file.write("\n")


if __name__ == "__main__":
    main()
