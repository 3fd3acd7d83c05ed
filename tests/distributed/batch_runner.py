"""Run several training configs one after another in ONE launch (torchrun or plain python),
so a test that compares N layouts pays the process start and megatron's import once, not N
times. The process group stays up between runs; megatron's model-parallel state is rebuilt
for each (different TP/PP sizes are fine within one world size).

    python batch_runner.py RUNS.json      # RUNS.json: a list of argv lists

An entry may instead be {"argv": [...], "defect": NAME}: the run with one of
`defects.py`'s planted defects, for the tests that show a comparison can fail.
"""

import contextlib
import json
import sys


def main(path: str) -> None:
    from megatron.core import parallel_state

    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.config import launch_world_size
    from megatron_gnmr.platform import quiet_known_warnings
    from megatron_gnmr.training import distributed
    from megatron_gnmr.training.loop import Trainer
    from megatron_gnmr.validation import validate

    from tests.distributed.defects import DEFECTS

    quiet_known_warnings()
    for entry in json.loads(open(path).read()):
        argv, defect = (entry["argv"], entry["defect"]) if isinstance(entry, dict) \
            else (entry, None)
        config = parse_config(argv)
        validate(config, launch_world_size())
        distributed.initialize(config)
        with DEFECTS[defect]() if defect else contextlib.nullcontext():
            trainer = Trainer(config)
            try:
                trainer.run()
            finally:
                trainer.close()
        parallel_state.destroy_model_parallel()
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
