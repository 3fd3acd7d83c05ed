"""Pretrain a LLaMA-style model on megatron-core, optionally under the GNMR controller.

    torchrun --nproc_per_node=2 pretrain_llama.py --config configs/tiny_cpu.yaml \
        --tensor-model-parallel-size 2 --gnmr --save runs/tiny

Flags override the YAML file; `--help` lists them all. A mistake in the input exits with
status 2 and one line naming the flag or file; nothing is written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megatron_gnmr.errors import exits_cleanly_on_user_error


@exits_cleanly_on_user_error
def main(argv: list[str] | None = None) -> dict:
    from megatron_gnmr.platform import quiet_known_warnings

    quiet_known_warnings()
    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.config import launch_world_size
    from megatron_gnmr.validation import validate

    config = parse_config(argv)
    validate(config, launch_world_size())

    from megatron_gnmr.errors import RunAborted
    from megatron_gnmr.platform.parent_death import end_with_the_agent
    from megatron_gnmr.training import distributed, run_directory
    from megatron_gnmr.training.consensus import on_every_rank
    from megatron_gnmr.training.loop import Trainer
    from megatron_gnmr.checkpoints.run_lock import RunLock

    end_with_the_agent()
    distributed.initialize(config)
    lock = RunLock(config.checkpoint.save) if config.checkpoint.save and \
        distributed.is_logging_rank() else None
    on_every_rank(lambda: lock.acquire() if lock else None)  # before anything is written
    if lock is not None and lock.taken_over:
        print(f"notice: {lock.taken_over}", file=sys.stderr)
    try:
        trainer = Trainer(config)
        try:
            summary = trainer.run()
        except RunAborted as error:  # stopped on purpose: torchrun must not train into it
            if config.checkpoint.save and distributed.is_logging_rank() and \
                    not isinstance(error, run_directory.StoppedBefore):
                run_directory.mark_stopped(config.checkpoint.save, error, trainer.state.step)
            raise
        finally:
            trainer.close()
    finally:
        if lock is not None:
            lock.release()
    # a run stopped by a signal or its time limit is not finished: no summary.json, so
    # whatever waits for one (reproduce, a job script) resumes it
    if config.checkpoint.save and distributed.is_logging_rank() and "exit" not in summary:
        path = Path(config.checkpoint.save) / "summary.json"
        path.write_text(json.dumps({"config": config.to_dict(), **summary}, indent=2,
                                   default=str))
    distributed.shutdown()
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
