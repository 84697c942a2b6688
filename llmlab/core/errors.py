"""User errors: one line on stderr, non-zero exit, no traceback."""
from __future__ import annotations

import functools
import sys


class UserError(Exception):
    """A problem with the user's input that they can fix; the message says how."""


def cli_entry(main):
    """Wrap a script's main(): known-harmless third-party notices off, and a UserError prints one line and exits 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        from llmlab.core.notices import quiet_known_notices

        quiet_known_notices()
        try:
            return main(*args, **kwargs)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:  # Ctrl-C before a trainer could say where it stood
            print("error: interrupted; nothing was published by this run", file=sys.stderr)
            sys.exit(130)

    return wrapper
