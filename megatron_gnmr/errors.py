"""UserError: a mistake in the user's input, reported as one line and exit status 2."""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable


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


def exits_cleanly_on_user_error(main: Callable) -> Callable:
    """Turn a UserError (or argparse's own exit) into one `error:` line and exit status 2,
    a RunAborted into one `stopped:` line and exit status 3, and a collective that lost its
    peers into one line saying so (exit 1: torchrun may restart it) instead of a traceback.
    Errors found by every rank alike (or agreed on by them, `training/consensus.py`) are
    printed by rank 0."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        rank = os.environ.get("RANK", "0")
        try:
            return main(*args, **kwargs)
        except (UserError, RunAborted) as error:
            if rank == "0":
                label = "error" if isinstance(error, UserError) else "stopped"
                print(f"{label}: {error}", file=sys.stderr, flush=True)
            sys.exit(error.exit_code)
        except Exception as error:
            if not lost_its_peers(error):
                raise
            first_line = str(error).strip().splitlines()[0][:200]
            print(f"error: rank {rank} lost its peers in a collective ({first_line}): another "
                  "rank failed or was killed (its own message is above), or a collective "
                  "outwaited --distributed-timeout-minutes", file=sys.stderr, flush=True)
            sys.exit(1)

    return wrapper
