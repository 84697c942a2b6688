"""User errors: one line on stderr, non-zero exit, no traceback."""

from __future__ import annotations

import errno
import faulthandler
import functools
import os
import sys
from contextlib import contextmanager
from typing import Iterator, Optional

from llmlab.core.notices import quiet_known_notices


class UserError(Exception):
    """A problem with the user's input that they can fix; the message says how."""

    exit_code = 2


class Waiting(UserError):
    """A run that stopped on purpose until the user acts (a registration to commit): what finished is reported
    before the one line."""


class Interrupted(UserError):
    """Ctrl-C, with where the run stands: exit status 130 as for any interrupted program (128 + SIGINT)."""

    exit_code = 130


# A full or read-only disk, however a library reports it: the OS's errno, numpy's short write ("N requested and M
# written"), torch's zip writer ("unexpected pos"), safetensors' Rust error ("os error 28").
_FULL = ("No space left", "unexpected pos", "os error 28", "requested and", "file write failed")


def write_failure(err: BaseException) -> Optional[str]:
    """What stopped a write, in words, if `err` is a failed write (else None: a bug, not the disk)."""
    code = getattr(err, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or any(marker in str(err) for marker in _FULL):
        return "the disk is full"
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return os.strerror(code).lower()
    return None


@contextmanager
def writing(what: str, fix: str) -> Iterator[None]:
    """Turn a failed write inside the block into one line naming what could not be written and the fix."""
    try:
        yield
    except UserError:
        raise
    except Exception as err:  # OSError, RuntimeError (torch), SafetensorError (a plain Exception) alike
        reason = write_failure(err)
        if reason is None:
            raise
        raise UserError(f"could not write {what}: {reason}; {fix}") from None


# An interrupted run has closed its files when it says so; what is left is the interpreter's exit, where a library's
# exit hook or thread has been seen (once in ~150 runs, under load) to hang past 2 minutes. Past this grace the
# process dumps every thread's stack to stderr (where it stalled, for a bug report) and exits with status 1.
EXIT_GRACE_S = 60.0


def _leave(code: int, main) -> None:
    # only where the script is the program: a main called from a notebook or a test leaves its caller running
    if getattr(main, "__module__", None) == "__main__":
        try:
            faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=sys.stderr)
        except (AttributeError, ValueError, OSError):  # a stderr with no file descriptor: no watchdog, still exit
            pass
    sys.exit(code)


def cli_entry(main):
    """Wrap a script's main(): known-harmless third-party notices off, and a UserError prints one line and exits 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        quiet_known_notices()
        try:
            return main(*args, **kwargs)
        except UserError as err:
            print(f"{'interrupted' if isinstance(err, Interrupted) else 'error'}: {err}", file=sys.stderr)
            _leave(err.exit_code, main)
        except KeyboardInterrupt:  # Ctrl-C before a trainer could say where it stood
            print("interrupted: nothing was published by this run", file=sys.stderr)
            _leave(130, main)
        except Exception as err:  # a write that failed where no caller named it: still one line, never a traceback
            reason = write_failure(err)
            if reason is None:
                raise
            where = getattr(err, "filename", None)
            print(
                f"error: a write failed{f' ({where})' if where else ''}: {reason}; free space or pick another output "
                "folder, then rerun (nothing half-written is kept)",
                file=sys.stderr,
            )
            sys.exit(2)

    return wrapper
