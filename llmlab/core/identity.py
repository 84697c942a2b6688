"""What a run builds on, fingerprinted: a resume, a merge and an evaluation check that the base weights and the data
are the ones the run started with (hashes are cheap next to training on the wrong thing)."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Iterable

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
BASE_RECORD = "llmlab_base.json"  # in an adapter folder: the base model it was trained on


def model_digest(name_or_path: str) -> str:
    """sha256 of a model folder's weight files (names and bytes); a hub name is identified by its name."""
    folder = Path(name_or_path).expanduser()
    if not folder.is_dir():
        return f"hub:{name_or_path}"
    digest = hashlib.sha256()
    files = sorted({p for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern)})
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return "sha256:" + digest.hexdigest()[:32]


def records_digest(records: Iterable) -> str:
    """sha256 of a dataset's examples in order (any JSON-serialisable records)."""
    digest = hashlib.sha256()
    for record in records:
        digest.update(json.dumps(record, sort_keys=True, default=str).encode() + b"\n")
    return "sha256:" + digest.hexdigest()[:32]


def file_sha256(path) -> str:
    """The full sha256 hex digest of one file's bytes (what a pre-registration is cited by)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def committed_as_is(path) -> tuple[str | None, str]:
    """(the commit that holds `path` byte for byte as it is on disk, "") or (None, why not): outside a git work tree,
    ignored, never committed, or changed since its last commit. What makes a pre-registration blind by rule: its
    commit precedes every trial it forecasts."""
    path = Path(path).resolve()

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(path.parent), *args], capture_output=True, text=True, timeout=60)

    try:
        if git("rev-parse", "--is-inside-work-tree").stdout.strip() != "true":
            return None, "it is not inside a git work tree"
    except (OSError, subprocess.SubprocessError):
        return None, "git is not available"
    if git("check-ignore", "-q", str(path)).returncode == 0:
        return None, "git ignores it"
    if (
        git("diff", "--quiet", "HEAD", "--", str(path)).returncode != 0
        or git("ls-files", "--error-unmatch", str(path)).returncode
    ):
        return None, "it is not committed as it is on disk"
    commit = git("log", "-n", "1", "--format=%H", "--", str(path)).stdout.strip()
    return (commit, "") if commit else (None, "it is not committed as it is on disk")
