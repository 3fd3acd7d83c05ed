"""Run several training configs one after another in ONE launch (torchrun or plain python):
`megatron_gnmr.experiments.in_sequence`, where an entry may also be {"argv": [...], "defect":
NAME}: the run with one of `defects.py`'s planted defects, for the tests that show a
comparison can fail.

    python batch_runner.py RUNS.json      # RUNS.json: a list of argv lists or such entries
"""

import contextlib
import json
import sys


def main(path: str) -> None:
    from megatron_gnmr.experiments.in_sequence import run_in_sequence
    from tests.distributed.defects import DEFECTS

    entries = json.loads(open(path).read())
    argvs = [entry["argv"] if isinstance(entry, dict) else entry for entry in entries]
    defects = [entry.get("defect") if isinstance(entry, dict) else None for entry in entries]
    run_in_sequence(argvs, lambda index: DEFECTS[defects[index]]() if defects[index]
                    else contextlib.nullcontext())


if __name__ == "__main__":
    main(sys.argv[1])
