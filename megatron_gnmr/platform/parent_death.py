"""A torchrun worker ends when its agent does.

torch's elastic agent starts each worker in a session of its own, so a `kill -9` to the job's
process group (what a scheduler or a user does to a hung job) kills the agent and leaves its
workers training: measured, a relaunch into the same run directory then trained beside them,
both writing checkpoints. Linux's parent-death signal (prctl PR_SET_PDEATHSIG) sends each
worker SIGTERM when its parent dies, into the run's SIGTERM path: the ranks save the step they
are in and exit. Elsewhere (macOS) nothing is set.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def end_with_the_agent() -> bool:
    """Under torchrun: SIGTERM to this process when its parent (the agent) dies. Returns
    whether it is set."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return False
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        return False
    if os.getppid() != parent:  # the agent died before the signal was set
        os.kill(os.getpid(), signal.SIGTERM)
    return True
