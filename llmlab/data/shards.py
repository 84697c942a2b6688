"""The token store: flat little-endian token files (uint16 while the vocabulary fits, else uint32), memory-mapped for
training, as nanoGPT's and llm.c's .bin files, plus a manifest (shard names, token counts, sha256, dtype).

A shard is written to a temp file, fsync'ed, hashed and only then renamed into place, so a killed or disk-full write
never leaves a file under a shard's name; the manifest that lists it is written after it. The reader checks every
shard's size against the manifest (a truncated file is named and refused) and, with `verify=True`, its sha256 (a
corrupted one too).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import numpy as np

from llmlab.core.errors import UserError
from llmlab.core.identity import file_sha256
from llmlab.core.io import atomic_write_json

MANIFEST = "manifest.json"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


class ShardWriter:
    """Appends tokens to `prefix_000000.bin`, `prefix_000001.bin`, ... of `shard_tokens` tokens each (the last one
    shorter), streaming to disk: memory never holds more than the array passed to add()."""

    def __init__(self, folder: Path, prefix: str, dtype: np.dtype, shard_tokens: int, start_index: int = 0):
        self.folder, self.prefix, self.dtype, self.shard_tokens = Path(folder), prefix, np.dtype(dtype), shard_tokens
        self.index, self.done, self.handle, self.in_shard, self.digest = start_index, [], None, 0, None

    def add(self, tokens: np.ndarray) -> list[dict]:
        """Write tokens; the records of the shards this call completed."""
        tokens = np.asarray(tokens)
        if tokens.size and int(tokens.max()) > np.iinfo(self.dtype).max:
            raise ValueError(f"token id {int(tokens.max())} does not fit {self.dtype}")
        finished = []
        while tokens.size:
            if self.handle is None:
                self._open()
            room = self.shard_tokens - self.in_shard
            part, tokens = tokens[:room], tokens[room:]
            data = part.astype(self.dtype, copy=False).tobytes()
            self.handle.write(data)
            self.digest.update(data)
            self.in_shard += len(part)
            if self.in_shard == self.shard_tokens:
                finished.append(self._seal())
        return finished

    def close(self) -> list[dict]:
        """Seal the last, partial shard (if any tokens went into it)."""
        if self.handle is None:
            return []
        if self.in_shard == 0:
            self._discard()
            return []
        return [self._seal()]

    def abort(self) -> None:
        if self.handle is not None:
            self._discard()

    def _name(self) -> str:
        return f"{self.prefix}_{self.index:06d}.bin"

    def _open(self) -> None:
        self.tmp = self.folder / f".{self._name()}.tmp-{os.getpid()}"
        self.handle, self.in_shard, self.digest = open(self.tmp, "wb"), 0, hashlib.sha256()

    def _seal(self) -> dict:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        os.replace(self.tmp, self.folder / self._name())
        record = {"file": self._name(), "tokens": self.in_shard, "sha256": self.digest.hexdigest()}
        self.handle, self.index = None, self.index + 1
        self.done.append(record)
        return record

    def _discard(self) -> None:
        try:
            self.handle.close()
        except OSError:  # a full disk can refuse the final flush too
            pass
        self.tmp.unlink(missing_ok=True)
        self.handle = None


def check_shards(folder: Path, records: list[dict], dtype: np.dtype, verify: bool) -> None:
    """Every listed shard exists at its recorded size, and with `verify` has its recorded sha256."""
    for record in records:
        path = folder / record["file"]
        expected = record["tokens"] * np.dtype(dtype).itemsize
        if not path.is_file():
            raise UserError(f"token shard {path} is missing; prepare the data again (delete {folder})")
        if path.stat().st_size != expected:
            raise UserError(
                f"token shard {path} is {path.stat().st_size} bytes, its manifest says {expected}: it is "
                f"truncated or was replaced; delete {folder} and prepare the data again"
            )
        if verify and file_sha256(path) != record["sha256"]:
            raise UserError(
                f"token shard {path} does not match its sha256 in {folder / MANIFEST}: it is corrupt; "
                f"delete {folder} and prepare the data again"
            )


class TokenBlocks:
    """One split of a prepared corpus as fixed-length blocks over its memory-mapped shards: block i is tokens
    [i * block_size, (i + 1) * block_size) of the split's token stream. Indexable like the Arrow datasets it
    replaces: `blocks[i]` -> {"input_ids": int64 tensor}, `len(blocks)`, `blocks["input_ids"]` (all, as an array)."""

    def __init__(
        self,
        folder: Path,
        split: str,
        block_size: int,
        verify: bool = False,
        manifest: Optional[dict] = None,
        mapped: bool = True,
    ):
        """`mapped=False` reads with pread instead of memory-mapping: for one pass over a corpus (packing), whose
        mapped pages would otherwise stay resident in the process until it ends."""
        self.folder, self.mapped = Path(folder), mapped
        manifest = manifest or json.loads((self.folder / MANIFEST).read_text())
        self.dtype = np.dtype(manifest["dtype"])
        self.records = manifest["splits"].get(split, [])
        check_shards(self.folder, self.records, self.dtype, verify)
        self.block_size = block_size
        self.starts = np.cumsum([0] + [r["tokens"] for r in self.records])
        self.tokens = int(self.starts[-1])
        self._maps: list[Optional[np.ndarray]] = [None] * len(self.records)
        self._files: dict[int, int] = {}

    def __len__(self) -> int:
        return self.tokens // self.block_size

    def _map(self, k: int) -> np.ndarray:
        if self._maps[k] is None:  # opened lazily: a DataLoader worker maps only what it reads
            self._maps[k] = np.memmap(self.folder / self.records[k]["file"], dtype=self.dtype, mode="r")
        return self._maps[k]

    def _slice(self, k: int, start: int, stop: int) -> np.ndarray:
        if self.mapped:
            return self._map(k)[start:stop]
        if k not in self._files:
            self._files[k] = os.open(self.folder / self.records[k]["file"], os.O_RDONLY)
        size = self.dtype.itemsize
        return np.frombuffer(os.pread(self._files[k], (stop - start) * size, start * size), dtype=self.dtype)

    def close(self) -> None:
        for handle in self._files.values():
            os.close(handle)
        self._files.clear()

    def window(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split as int64, across shard boundaries."""
        parts, k = [], int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self.starts[k + 1]))
            parts.append(self._slice(k, start - self.starts[k], end - self.starts[k]))
            start, k = end, k + 1
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

    def __getitem__(self, key):
        if key == "input_ids":
            return self.window(0, len(self) * self.block_size).reshape(len(self), self.block_size)
        import torch

        if not 0 <= key < len(self):
            raise IndexError(key)
        return {"input_ids": torch.from_numpy(self.window(key * self.block_size, (key + 1) * self.block_size))}

    def with_format(self, _format: str) -> "TokenBlocks":
        return self


def write_manifest(folder: Path, manifest: dict) -> None:
    atomic_write_json(Path(folder) / MANIFEST, manifest)
