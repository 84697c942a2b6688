"""A run folder has one owner at a time, and a new run never silently lands on an old one.

`claim_run_folder` (main process only) takes an exclusive lock on OUTPUT_DIR/.llmlab.lock with fcntl.flock: the
kernel drops it when the process dies, so a lock left by a killed run is free again and is taken over with a
note naming the dead pid. A second live run in the same folder is refused in one line. Then the Hugging Face
convention: a folder that already holds a run refuses a fresh start unless `--resume_from_checkpoint` or
`--overwrite_output_dir` is given, and overwriting deletes only what a run of this kind writes.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

from llmlab.core.errors import UserError

LOCK_NAME = ".llmlab.lock"
_held: dict[str, int] = {}  # resolved folder -> open lock fd: kept for the life of the process


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
    """Hold the folder's lock for the rest of this process. Returns a note when a dead run's lock was taken over."""
    folder.mkdir(parents=True, exist_ok=True)
    key = str(folder.resolve())
    if key in _held:
        return None
    path = folder / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        owner = _read_owner(path)
        raise UserError(f"{folder} is in use by another {what} (pid {owner.get('pid', '?')} on "
                        f"{owner.get('host', '?')}, started {owner.get('started', '?')}); wait for it to finish or "
                        "pick another --output_dir") from None
    previous = _read_owner(path)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": sys.argv}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    _held[key] = fd
    if previous.get("pid") and previous.get("released") is not True:
        return (f"note: {folder} was locked by pid {previous['pid']} on {previous.get('host', '?')}, which ended "
                "without releasing it; taking it over")
    return None


def release_lock(folder: Path) -> None:
    """Mark the lock released (a later run then takes it without a note) and drop it."""
    fd = _held.pop(str(Path(folder).resolve()), None)
    if fd is None:
        return
    try:
        owner = _read_owner(Path(folder) / LOCK_NAME)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps({**owner, "released": True}) + "\n").encode(), 0)
    finally:
        os.close(fd)


def _read_owner(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def claim_run_folder(path: str | os.PathLike, run_files: Iterable[str], *, resume: bool, overwrite: bool,
                     what: str = "run") -> tuple[Path, Optional[str]]:
    """Lock OUTPUT_DIR and apply the fresh / resume / overwrite policy. `run_files` are the names a run of
    this kind writes there: their presence means the folder holds a run, and only they are ever deleted."""
    folder = check_output_dir(path)
    note = acquire_lock(folder, what)
    found = [name for name in run_files if (folder / name).exists()]
    if found and not resume:
        if not overwrite:
            raise UserError(f"{folder} already holds a {what} ({', '.join(found[:3])}); pass "
                            "--resume_from_checkpoint latest to continue it, --overwrite_output_dir to replace it, "
                            "or pick a new --output_dir")
        for name in found:  # only what a run writes: anything else the user keeps there stays
            target = folder / name
            shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
    return folder, note


def process_start_time(pid: int) -> Optional[str]:
    """Linux: a process's start time in clock ticks (field 22 of /proc/PID/stat). With the pid it names one
    process, even after the pid is reused. None when the process is gone (or on systems without /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]
