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


def exits_cleanly_on_user_error(main: Callable) -> Callable:
    """Turn a UserError (or argparse's own exit) into one `error:` line and exit status 2,
    and a RunAborted into one `stopped:` line and exit status 3."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except (UserError, RunAborted) as error:
            if os.environ.get("RANK", "0") == "0":  # every rank finds it; one says it
                label = "error" if isinstance(error, UserError) else "stopped"
                print(f"{label}: {error}", file=sys.stderr, flush=True)
            sys.exit(error.exit_code)

    return wrapper
