"""User errors: one line on stderr, non-zero exit, no traceback."""
from __future__ import annotations

import functools
import sys


class UserError(Exception):
    """A problem with the user's input that they can fix; the message says how."""

    exit_code = 2


class Interrupted(UserError):
    """Ctrl-C, with where the run stands: exit status 130 as for any interrupted program (128 + SIGINT)."""

    exit_code = 130


def cli_entry(main):
    """Wrap a script's main(): known-harmless third-party notices off, and a UserError prints one line and exits 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        from llmlab.core.notices import quiet_known_notices

        quiet_known_notices()
        try:
            return main(*args, **kwargs)
        except UserError as err:
            print(f"{'interrupted' if isinstance(err, Interrupted) else 'error'}: {err}", file=sys.stderr)
            sys.exit(err.exit_code)
        except KeyboardInterrupt:  # Ctrl-C before a trainer could say where it stood
            print("interrupted: nothing was published by this run", file=sys.stderr)
            sys.exit(130)

    return wrapper
