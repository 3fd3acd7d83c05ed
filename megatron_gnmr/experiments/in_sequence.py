"""Several training runs one after another in one process, so a benchmark or a test that
compares N runs pays the process start, the imports and the process group once, not N times.

Megatron's model-parallel state is rebuilt for each run (runs of one world size may differ in
layout), and megatron-core's record of the attention backend is forgotten between them, so
each run decides its own as a launch of its own would. A run's failure ends the sequence.

    torchrun --nproc_per_node=2 -m megatron_gnmr.experiments.in_sequence RUNS.json

RUNS.json: a list of argv lists, as `pretrain_llama.py` takes them.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Sequence
from typing import ContextManager


def run_in_sequence(argvs: Sequence[list[str]],
                    around: Callable[[int], ContextManager] | None = None) -> None:
    """Train each argv in turn; `around(i)`, if given, is entered around run i's build and
    training (a test's planted defect)."""
    from megatron.core import parallel_state

    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.config import launch_world_size
    from megatron_gnmr.platform import attention_environment, quiet_known_warnings
    from megatron_gnmr.training import distributed
    from megatron_gnmr.training.loop import Trainer
    from megatron_gnmr.validation import validate

    quiet_known_warnings()
    for index, argv in enumerate(argvs):
        attention_environment.forget()
        config = parse_config(argv)
        validate(config, launch_world_size())
        distributed.initialize(config)
        with around(index) if around else contextlib.nullcontext():
            trainer = Trainer(config)
            try:
                trainer.run()
            finally:
                trainer.close()
        parallel_state.destroy_model_parallel()
    distributed.shutdown()


if __name__ == "__main__":
    run_in_sequence(json.loads(open(sys.argv[1]).read()))
