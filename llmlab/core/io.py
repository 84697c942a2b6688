"""Atomic file writes: a crash mid-write never leaves a half-written file under the final name."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from llmlab.core.errors import UserError

_UMASK = os.umask(0)
os.umask(_UMASK)


def llmlab_cache(name: str) -> Path:
    """The folder for one kind of cached artefact: $LLMLAB_CACHE/<name>, else ~/.cache/llmlab/<name>."""
    return Path(os.environ.get("LLMLAB_CACHE") or Path.home() / ".cache" / "llmlab") / name


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temp file in the same folder, fsync, then rename: readers see the old file or the new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file normal permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Append one line; a line is written with a single write() so readers never see half a record."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSONL log, ignoring a torn last line left by a killed writer."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def normal_modes(folder: str | os.PathLike) -> None:
    """Give every file and folder under `folder` the modes the user's umask would: writers that go through temp files
    (mkstemp, save_pretrained's safetensors) leave 0600, which other users and tools cannot read."""
    folder = Path(folder)
    os.chmod(folder, 0o777 & ~_UMASK)
    for path in folder.rglob("*"):
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~_UMASK)


def publish_dir(tmp_dir: str | os.PathLike, final_dir: str | os.PathLike) -> None:
    """Move a fully written temp directory into place (with normal file modes); an old directory of that name is
    replaced."""
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    normal_modes(tmp_dir)
    if final_dir.exists():
        trash = final_dir.with_name(f".{final_dir.name}.old")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final_dir, trash)
        os.replace(tmp_dir, final_dir)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp_dir, final_dir)


# compressed files by suffix: the magic bytes the stream must start with, and the module that opens it
COMPRESSION = {
    ".gz": (b"\x1f\x8b", "gzip"),
    ".bz2": (b"BZh", "bz2"),
    ".xz": (b"\xfd7zXZ\x00", "lzma"),
    ".zst": (b"\x28\xb5\x2f\xfd", "zstandard"),
}


def compression_of(path: str | os.PathLike) -> Optional[str]:
    """The compression suffix of a path (".gz", ".bz2", ".xz", ".zst"), or None for a plain file."""
    suffix = Path(path).suffix
    return suffix if suffix in COMPRESSION else None


def open_binary(path: str | os.PathLike):
    """A binary stream of the file's content, decompressed when its suffix names a compression, after checking its
    magic bytes (a .gz that is not gzip is one line naming the file, not a decoder error later)."""
    suffix = compression_of(path)
    if suffix is None:
        return open(path, "rb")
    magic, module = COMPRESSION[suffix]
    with open(path, "rb") as f:
        head = f.read(len(magic))
    if head != magic:
        raise UserError(
            f"{path} is not a {suffix} file (it does not start with {suffix}'s magic bytes); decompress or rename it"
        )
    if module == "zstandard":
        return io.BufferedReader(_ZstdReader(path), 1 << 20)
    return __import__(module).open(path, "rb")


class _ZstdReader(io.RawIOBase):
    """A .zst file's content across its frames, raising EOFError when the file ends inside a frame (zstandard's own
    stream reader ends quietly there, which would pass a truncated download as a shorter corpus)."""

    def __init__(self, path):
        import zstandard

        self._file, self._new = open(path, "rb"), zstandard.ZstdDecompressor().decompressobj
        self._stream, self._pending, self._started = self._new(), b"", False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            chunk = self._file.read(1 << 20)
            if not chunk:
                if not self._stream.eof and self._started:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            self._pending = self._decompress(chunk)
        size = min(len(buffer), len(self._pending))
        buffer[:size], self._pending = self._pending[:size], self._pending[size:]
        return size

    def _decompress(self, chunk: bytes) -> bytes:
        out = []
        while chunk:
            if self._stream.eof:  # the next frame
                self._stream = self._new()
            out.append(self._stream.decompress(chunk))
            self._started = True
            chunk = self._stream.unused_data if self._stream.eof else b""
        return b"".join(out)

    def close(self) -> None:
        self._file.close()
        super().close()


def utf8_lines(path: str | os.PathLike, max_bytes: Optional[int] = None):
    """(line number, text) for each line of a UTF-8 file, plain or compressed (COMPRESSION), streamed; bytes that are
    not UTF-8 are a one-line error naming the file, line and column, and a truncated or corrupt compressed stream one
    naming the file, instead of a decoder traceback deep inside a loader. With `max_bytes`, a longer line is a
    one-line error once that many of its bytes are read: it is never read whole."""
    number = 0
    limit = -1 if max_bytes is None else max_bytes + 1
    try:
        with open_binary(path) as f:
            while raw := f.readline(limit):
                number += 1
                if max_bytes is not None and len(raw) > max_bytes:
                    raise UserError(
                        f"{path}:{number} is a line of over {max_bytes / 2**20:,.0f} MB, more than a record is read "
                        "whole; put texts that long in .txt files (streamed at any size), one per file"
                    )
                try:
                    yield number, raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise UserError(
                        f"{path}:{number} is not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                        f"{err.start + 1}); save the file as UTF-8"
                    ) from None
    except UserError:
        raise
    except Exception as err:  # each decompressor has its own error types (EOFError, OSError, LZMAError, ZstdError)
        if compression_of(path) is None:
            raise
        detail = str(err).splitlines()[0][:100] if str(err) else "end of stream"
        raise UserError(
            f"{path} is truncated or corrupt ({type(err).__name__}: {detail}; {number} lines read before it); "
            "download or compress it again"
        ) from None


def progress_bar(**kwargs):
    """tqdm on a terminal; in a log file or pipe one line a minute instead of a carriage-return frame per update,
    so a day-long run's log stays readable."""
    from tqdm.auto import tqdm

    tty = sys.stderr.isatty()
    return tqdm(mininterval=0.5 if tty else 60, dynamic_ncols=tty, **kwargs)
