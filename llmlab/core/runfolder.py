"""A run folder has one owner at a time, holds one kind of run, and a new run never silently lands on an old one.

`claim_run_folder` (main process only) takes an exclusive lock on OUTPUT_DIR/.llmlab.lock (filelock: fcntl on
Linux and macOS, msvcrt on Windows); the OS drops it when the process dies, so a lock left by a killed run is free
again and is taken over with a note naming the dead pid. Who holds it is recorded in .llmlab.owner (the lock file
itself may be truncated by a contender). A second live run in the same folder is refused in one line naming the
owner's kind and pid. The folder's kind (pretraining, lora, sweep) is recorded in .llmlab.kind: a run of another kind
is refused before anything is touched. Then the Hugging Face convention: a folder that already holds a run refuses
a fresh start unless `--resume_from_checkpoint` or `--overwrite_output_dir` is given, and overwriting deletes only
what a run of this kind writes. A refused claim leaves the folder exactly as it found it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

from filelock import FileLock, Timeout

from llmlab.core.errors import UserError
from llmlab.core.io import atomic_write_json, atomic_write_text

LOCK_NAME = ".llmlab.lock"
OWNER_NAME = ".llmlab.owner"
KIND_NAME = ".llmlab.kind"
_held: dict[str, FileLock] = {}  # resolved folder -> the lock this process holds for its whole life


def check_output_dir(path: str | os.PathLike, option: str = "--output_dir") -> Path:
    """Refuse, before any slow setup, an output folder that is a file or cannot be written."""
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{option} {folder} is a file, not a folder; pass a folder path")
    parent = next((p for p in [folder, *folder.parents] if p.exists()), Path("."))
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{option} {folder}: {parent} is not writable; pick a folder you can write to")
    return folder


def acquire_lock(folder: Path, what: str = "run") -> Optional[str]:
    """Hold the folder's lock for the rest of this process and record the owner. Returns a note when the lock of a
    run that died without releasing it was taken over."""
    if not _lock(folder, what):
        return None
    return _record_owner(folder, what)


def _lock(folder: Path, what: str) -> bool:
    """Take the folder's lock (False: this process holds it already); a live owner is a one-line refusal."""
    folder.mkdir(parents=True, exist_ok=True)
    if str(folder.resolve()) in _held:
        return False
    lock = FileLock(str(folder / LOCK_NAME))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        owner = read_owner(folder)
        raise UserError(
            f"{folder} is in use by another {owner.get('kind', 'run')} (pid {owner.get('pid', '?')} on "
            f"{owner.get('host', '?')}, started {owner.get('started', '?')}); wait for it to finish or "
            "pick another --output_dir"
        ) from None
    _held[str(folder.resolve())] = lock
    return True


def _record_owner(folder: Path, what: str) -> Optional[str]:
    previous = read_owner(folder)
    _write_owner(
        folder,
        {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "kind": what,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": sys.argv,
        },
    )
    if previous.get("pid") and previous.get("released") is not True:
        return (
            f"note: {folder} was locked by pid {previous['pid']} on {previous.get('host', '?')}, which ended "
            "without releasing it; taking it over"
        )
    return None


def release_lock(folder: Path, record: bool = True) -> None:
    """Mark the lock released (a later run then takes it without a note) and drop it; `record=False` drops it without
    touching the owner record (a refused claim, which must leave the folder as it found it)."""
    lock = _held.pop(str(Path(folder).resolve()), None)
    if lock is None:
        return
    try:
        if record:
            _write_owner(Path(folder), {**read_owner(Path(folder)), "released": True})
    finally:
        lock.release()


def read_owner(folder: Path) -> dict:
    try:
        owner = json.loads((folder / OWNER_NAME).read_text() or "{}")
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_owner(folder: Path, record: dict) -> None:
    atomic_write_json(folder / OWNER_NAME, record)


def folder_kind(folder: Path) -> Optional[str]:
    """The kind of run a folder holds: its .llmlab.kind record, or for folders written before that record, the
    script its run_info.json names."""
    try:
        return (folder / KIND_NAME).read_text().strip() or None
    except OSError:
        pass
    try:
        command = json.loads((folder / "run_info.json").read_text()).get("command") or []
    except (OSError, ValueError, AttributeError):
        return None
    script = Path(str(command[0] if isinstance(command, list) and command else command)).name
    return {"train_pretrain.py": "pretraining", "train_lora.py": "lora", "sweep.py": "sweep"}.get(script)


def claim_run_folder(
    path: str | os.PathLike,
    run_files: Iterable[str],
    *,
    resume: bool,
    overwrite: bool,
    what: str = "run",
    record: bool = True,
) -> tuple[Path, Optional[str]]:
    """Lock OUTPUT_DIR and apply the kind and fresh / resume / overwrite policy. `run_files` are the names a run of
    this kind writes there: their presence means the folder holds a run, and only they are ever deleted. Every check
    runs before anything is written: a refusal leaves the folder as it was (and removes it if this claim made it).
    `record=False` leaves the owner and kind records to `record_claim`, for callers with checks still to run."""
    folder = check_output_dir(path)
    new_dirs = [p for p in [folder, *folder.parents] if not p.exists()]  # what this claim would create
    if not _lock(folder, what):
        return folder, None
    try:
        kind = folder_kind(folder)
        if kind is not None and kind != what:
            raise UserError(
                f"{folder} holds a {kind} run; a {what} run cannot use it (nothing was changed): pick "
                "another --output_dir"
            )
        found = [name for name in run_files if (folder / name).exists()]
        if found and not resume and not overwrite:
            raise UserError(
                f"{folder} already holds a {what} ({', '.join(found[:3])}); pass "
                "--resume_from_checkpoint latest to continue it, --overwrite_output_dir to replace it, "
                "or pick a new --output_dir"
            )
    except UserError:
        release_lock(folder, record=False)
        _remove_created(folder, new_dirs)
        raise
    if found and not resume:
        for name in found:  # only what a run of this kind writes: anything else the user keeps there stays
            target = folder / name
            shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
    return folder, record_claim(folder, what) if record else None


def record_claim(folder: Path, what: str) -> Optional[str]:
    """Write who owns the folder and what kind of run it holds, once every check passed."""
    note = _record_owner(folder, what)
    atomic_write_text(folder / KIND_NAME, what + "\n")
    return note


def abandon_claim(folder: Path) -> None:
    """A run refused after claiming (e.g. its resume did not match): drop the lock, write nothing."""
    release_lock(folder, record=False)


def _remove_created(folder: Path, new_dirs: list[Path]) -> None:
    """Undo a refused claim in a folder it created: its lock file, then the folders it made, if still empty."""
    if not new_dirs:
        return
    (folder / LOCK_NAME).unlink(missing_ok=True)
    for made in new_dirs:  # innermost first
        try:
            made.rmdir()
        except OSError:
            return


def process_start_time(pid: int) -> Optional[str]:
    """Linux: a process's start time in clock ticks (field 22 of /proc/PID/stat). With the pid it names one
    process, even after the pid is reused. None when the process is gone (or on systems without /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]
