"""UserError: a mistake in the user's input, reported as one line and exit status 2."""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable


class UserError(Exception):
    """A bad flag, YAML key, data file or checkpoint. The message names it and the fix."""

    exit_code = 2


def exits_cleanly_on_user_error(main: Callable) -> Callable:
    """Turn a UserError (or argparse's own exit) into one `error:` line and exit status 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as error:
            if os.environ.get("RANK", "0") == "0":  # every rank finds it; one says it
                print(f"error: {error}", file=sys.stderr, flush=True)
            sys.exit(UserError.exit_code)

    return wrapper
