"""What a run builds on, fingerprinted: a resume, a merge and an evaluation check that the base weights and the data
are the ones the run started with (hashes are cheap next to training on the wrong thing)."""

from __future__ import annotations

import hashlib
import json
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
