"""UserError: a mistake in the user's input, reported as one line and exit status 2.

Under torchrun the line also goes where torch elastic's agent looks for a worker's cause of
failure: the JSON file its TORCHELASTIC_ERROR_FILE names (one per worker), in the format of
torch's own `ErrorHandler.record_exception`. The agent's summary (`ChildFailedError`) then
names that line as the root cause, instead of `error_file: <N/A>` and a link to its docs.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Callable

ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # set by torchrun's agent for each worker it starts


class UserError(Exception):
    """A bad flag, YAML key, data file or checkpoint. The message names it and the fix."""

    exit_code = 2


class RunAborted(RuntimeError):
    """The run stopped itself to protect the model (non-finite gradients, ranks that
    disagree). Reported as one line with exit status 3; the checkpoints are kept."""

    exit_code = 3


LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was "
             "aborted", "Watchdog caught collective operation timeout")


def lost_its_peers(error: BaseException) -> bool:
    """A collective failed because another rank died or a collective timed out."""
    try:
        import torch.distributed as dist

        if isinstance(error, dist.DistError):
            return True
    except ImportError:
        pass
    return isinstance(error, RuntimeError) and any(text in str(error) for text in LOST_PEER)


def tell_the_agent(line: str, consequence: bool = False) -> None:
    """Under torchrun, write `line` as this worker's cause of failure into the error file the
    agent reads (torch elastic's protocol: {"message": {"message", "extraInfo":
    {"py_callstack", "timestamp"}}}, as ErrorHandler.record_exception writes it). The
    summary shows `py_callstack` as the worker's traceback: here the line is the whole story.
    The agent's root cause is the failure with the earliest timestamp, in whole seconds; a
    `consequence` of another worker's failure (a lost peer) is dated a second later, so that
    it never wins a tie against its cause. Nothing outside torchrun."""
    path = os.environ.get(ERROR_FILE)
    if not path:
        return
    when = int(time.time()) + (1 if consequence else 0)
    record = {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(when)}}
    try:
        with open(path, "w") as file:
            json.dump({"message": record}, file)
    except OSError:
        pass  # the agent then reports the exit status alone, as before


def exits_cleanly_on_user_error(main: Callable) -> Callable:
    """Turn a UserError (or argparse's own exit) into one `error:` line and exit status 2,
    a RunAborted into one `stopped:` line and exit status 3, and a collective that lost its
    peers into one line saying so (exit 1: torchrun may restart it) instead of a traceback.
    Errors found by every rank alike (or agreed on by them, `training/consensus.py`) are
    printed by rank 0; every rank tells torchrun's agent (`tell_the_agent`), since the
    agent's root cause is whichever worker failed first. Under torchrun any other exception
    is recorded by torch elastic's own `record`, so the summary shows its traceback."""

    @functools.wraps(main)
    def one_line(*args, **kwargs):
        rank = os.environ.get("RANK", "0")
        try:
            return main(*args, **kwargs)
        except (UserError, RunAborted) as error:
            line = f"{'error' if isinstance(error, UserError) else 'stopped'}: {error}"
            if rank == "0":
                print(line, file=sys.stderr, flush=True)
            tell_the_agent(line)
            sys.exit(error.exit_code)
        except Exception as error:
            if not lost_its_peers(error):
                raise
            first_line = str(error).strip().splitlines()[0][:200]
            line = (f"error: rank {rank} lost its peers in a collective ({first_line}): "
                    "another rank failed or was killed (its own message is above), or a "
                    "collective outwaited --distributed-timeout-minutes")
            print(line, file=sys.stderr, flush=True)
            tell_the_agent(line, consequence=True)
            sys.exit(1)

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        if not os.environ.get(ERROR_FILE):
            return one_line(*args, **kwargs)
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(one_line)(*args, **kwargs)

    return wrapper
