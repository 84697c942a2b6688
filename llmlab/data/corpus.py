"""Corpus sources: the builtin Wikipedia sample, a hub dataset, or local .txt/.jsonl/.json/.parquet files (the text
formats also compressed: .gz, .bz2, .xz, .zst).

Each source streams its documents one at a time (iter_documents), plus a fingerprint that changes whenever the
source's content may have changed (it keys the prepared-data cache).
"""

from __future__ import annotations

import bz2
import codecs
import importlib.util
import json
import os
from pathlib import Path
from typing import Optional

from llmlab.core.errors import UserError
from llmlab.core.io import COMPRESSION, compression_of, open_binary, utf8_lines

BUILTIN_WIKI = "builtin:wiki"
TEXT_SUFFIXES = (".txt", ".jsonl", ".json")  # .json: JSON lines, as C4 and RedPajama ship them
LOCAL_SUFFIXES = (*TEXT_SUFFIXES, ".parquet", *(t + c for t in TEXT_SUFFIXES for c in COMPRESSION))
FORMATS = ".txt, .jsonl, .json (JSON lines) or .parquet, the text formats also as .gz, .bz2, .xz or .zst"
_WIKI_DUMP = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def builtin_wiki_path() -> Path:
    spec = importlib.util.find_spec("gensim")  # locate without importing (gensim's import costs ~2 s)
    if spec is None or spec.origin is None:
        raise UserError("builtin:wiki needs gensim (it ships the Wikipedia sample): pip install -r requirements.txt")
    path = Path(spec.origin).parent / _WIKI_DUMP
    if not path.is_file():
        raise UserError(f"this gensim does not ship {_WIKI_DUMP}; pip install gensim==4.4.0 or pass --dataset FILES")
    return path


def looks_local(source: str) -> bool:
    """A path-like source is read from disk; anything else is a hub dataset name."""
    return (
        os.path.exists(source)
        or source.endswith(LOCAL_SUFFIXES)
        or source.startswith((".", "/", "~"))
        or os.sep in source
        and not _looks_like_hub_repo(source)
    )


def _looks_like_hub_repo(source: str) -> bool:
    # "org/name" is a hub repo id; "dir/sub/file" or "dir/" is a path.
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.endswith(LOCAL_SUFFIXES)


def corpus_format(path: Path) -> Optional[str]:
    """ ".txt", ".jsonl" (also for .json) or ".parquet", whatever the compression; None for any other file."""
    name = path.name[: -len(compression_of(path))] if compression_of(path) else path.name
    base = Path(name).suffix
    if base == ".parquet" and not compression_of(path):
        return ".parquet"
    return {".txt": ".txt", ".jsonl": ".jsonl", ".json": ".jsonl"}.get(base)


def local_files(source: str) -> list[Path]:
    """The corpus files a local source names: a file, or every supported file under a folder."""
    path = Path(source).expanduser()
    if not path.exists():
        raise UserError(f"dataset path {source} does not exist; pass an existing file or folder ({FORMATS})")
    if path.is_file():
        if corpus_format(path) is None:
            raise UserError(f"{source}: unsupported file type {''.join(path.suffixes[-2:])!r}; use {FORMATS}")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and corpus_format(p))
    if not files:
        raise UserError(f"folder {source} holds no corpus files ({FORMATS}); point --dataset at your corpus")
    return files


def source_fingerprint(source: str, dataset_config: Optional[str], text_field: str) -> dict:
    """What identifies the raw documents: for local files their paths, sizes and modification times."""
    if source == BUILTIN_WIKI:
        path = builtin_wiki_path()
        return {"source": source, "file": path.name, "size": path.stat().st_size}
    if looks_local(source):
        files = local_files(source)
        return {
            "source": "local",
            "text_field": text_field,
            "files": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files],
        }
    return {"source": "hub", "name": source, "config": dataset_config, "text_field": text_field}


def iter_documents(source: str, dataset_config: Optional[str], text_field: str):
    """The raw documents of `source` one at a time, in a fixed order, never all in memory: the builtin sample's
    articles, local files in sorted order (.txt one document, .jsonl one per line, .parquet one per row, each cut
    at MAX_DOCUMENT_CHARS), or a hub dataset read with streaming=True. Non-UTF-8 input is a one-line error naming
    the file and line (or row)."""
    if source == BUILTIN_WIKI:
        yield from _wiki_article_markup(builtin_wiki_path(), None)
        return
    if not looks_local(source):
        yield from _stream_hub_corpus(source, dataset_config, text_field)
        return
    for path in local_files(source):
        kind = corpus_format(path)
        if kind == ".txt":
            yield from text_file_pieces(path)  # one document per file, streamed in pieces, strictly UTF-8
        elif kind == ".jsonl":
            yield from _jsonl_texts(path, text_field)
        else:
            yield from _parquet_texts(path, text_field)


def _parquet_texts(path: Path, text_field: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for a corrupt file
        raise UserError(f"{path} is not a readable parquet file ({str(err).splitlines()[0][:120]})") from None
    if text_field not in handle.schema_arrow.names:
        raise UserError(
            f"{path} has no column {text_field!r} (columns: {', '.join(handle.schema_arrow.names)}); "
            "pass --text_field NAME"
        )
    row = 0
    for batch in handle.iter_batches(columns=[text_field], batch_size=1024):
        column = batch.column(0)
        if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
            for offset, value in enumerate(column.to_pylist()):  # bytes: decode strictly, naming the row
                try:
                    text = value.decode("utf-8") if value is not None else None
                except UnicodeDecodeError as err:
                    raise UserError(
                        f"{path}: row {row + offset + 1} of column {text_field!r} is not UTF-8 text "
                        f"(byte 0x{value[err.start]:02x} at position {err.start + 1}); store UTF-8 "
                        "strings"
                    ) from None
                if text is not None:
                    yield from split_long_document(text)
        elif pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            for text in column.to_pylist():  # Arrow strings are validated UTF-8
                if text is not None:
                    yield from split_long_document(text)
        else:
            raise UserError(f"{path}: column {text_field!r} holds {column.type}, not text; pass --text_field NAME")
        row += len(column)


def _jsonl_texts(path: Path, text_field: str):
    # streamed; non-UTF-8 bytes and a line over MAX_JSON_LINE_BYTES are one-line errors naming the line
    for line_no, line in utf8_lines(path, max_bytes=MAX_JSON_LINE_BYTES):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{line_no} is not valid JSON ({err.msg}); fix or remove that line") from None
        if not isinstance(record, dict) or text_field not in record:
            raise UserError(
                f"{path}:{line_no} has no field {text_field!r}; give every line that field or pass --text_field NAME"
            )
        value = record[text_field]
        if not isinstance(value, str):
            raise UserError(f"{path}:{line_no} field {text_field!r} is {type(value).__name__}, expected a string")
        yield from split_long_document(value)


def _stream_hub_corpus(name: str, dataset_config: Optional[str], text_field: str):
    import datasets

    try:
        loaded = datasets.load_dataset(name, dataset_config, streaming=True)
        split = "train" if "train" in loaded else next(iter(loaded))
        stream = iter(loaded[split])
        first = next(stream, None)
    except Exception as err:  # offline, unknown name, bad config: datasets raises many types
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        config = f" (config {dataset_config})" if dataset_config else ""
        raise UserError(
            f"cannot load dataset {name!r}{config} from the Hugging Face hub: {reason}; "
            "connect to the internet (and unset HF_DATASETS_OFFLINE), or pass local "
            ".txt/.jsonl/.parquet files or a folder"
        ) from None
    if first is not None and text_field not in first:
        raise UserError(
            f"dataset {name!r} has no column {text_field!r} (columns: {', '.join(first)}); pass --text_field NAME"
        )
    for record in [first] if first is not None else []:
        if record[text_field] is not None:
            yield from split_long_document(record[text_field])
    for record in stream:
        if record[text_field] is not None:
            yield from split_long_document(record[text_field])


def _wiki_article_markup(path: Path, max_documents: Optional[int]):
    """Raw wikitext of the dump's main-namespace articles; redirect pages skipped."""
    from gensim.corpora.wikicorpus import extract_pages

    count = 0
    with bz2.open(path, "rb") as f:
        for _title, text, _pageid in extract_pages(f, filter_namespaces=("0",)):
            if max_documents is not None and count >= max_documents:
                return
            if text.lstrip()[:9].upper() == "#REDIRECT":
                continue
            count += 1
            yield text


# A document is cleaned, shingled and tokenised in one piece; a 50 MB one-line file done so peaked at 7.6 GB.
# Longer documents are cut into pieces of at most this many characters (~50k tokens), at a line break or space when
# possible, so the memory a worker's batch needs never grows with the file. The pieces stay one document: no eos
# between them, packed together in one split (prepare._process_batch, prepare._pack).
MAX_DOCUMENT_CHARS = 200_000
# A JSON line is parsed whole (the record, then its text field): a longer one is refused before it is read whole.
MAX_JSON_LINE_BYTES = 64 * 2**20


class Piece(str):
    """A piece of a document longer than MAX_DOCUMENT_CHARS: `first` when it starts the document, `continues` when
    more of it follows. Pieces are exempt from the per-document rules (too short, exact and near duplicates), are
    stripped only where the document starts and ends, and get no eos until the last one: the document stays whole."""

    first: bool = False
    continues: bool = False

    def __new__(cls, text: str, first: bool, continues: bool):
        piece = super().__new__(cls, text)
        piece.first, piece.continues = first, continues
        return piece

    def __reduce__(self):  # to a pool worker and back with its flags
        return (Piece, (str(self), self.first, self.continues))


def split_long_document(text: str, limit: int = MAX_DOCUMENT_CHARS) -> list[str]:
    """[text] when it fits in one piece, else its Pieces, each cut after a line break or space where one lies in
    the piece."""
    if len(text) <= limit:
        return [text]
    pieces, start = [], 0
    while start < len(text):
        end = min(start + limit, len(text))
        if end < len(text):
            cut = max(text.rfind("\n", start, end), text.rfind(" ", start, end))
            end = cut + 1 if cut > start else end
        pieces.append(Piece(text[start:end], first=start == 0, continues=end < len(text)))
        start = end
    return pieces


def text_file_pieces(path: Path, limit: int = MAX_DOCUMENT_CHARS):
    """A .txt file as one document, read in bounded pieces: never more than ~2 x `limit` characters in memory, whatever
    the file's size or the length of its lines. Pieces are cut after the last line break in reach (else a space, else
    anywhere), where GPT-2's BPE splits anyway; a file that fits in one piece is one plain document, as before."""
    held = None  # the last cut piece: whether it `continues` is known once the next one exists
    pending, size, first = [], 0, True
    for text in _decoded_chunks(path, 4 * limit):
        pending.append(text)
        size += len(text)
        while size > limit:
            joined = "".join(pending)
            newline = joined.rfind("\n", 0, limit)
            cut = newline + 1 if newline >= 0 else (joined.rfind(" ", 0, limit) + 1 or limit)
            if held is not None:
                yield Piece(held, first=first, continues=True)
                first = False
            held, pending, size = joined[:cut], [joined[cut:]], len(joined) - cut
    rest = "".join(pending)
    if held is None:
        yield rest
        return
    yield Piece(held, first=first, continues=bool(rest))
    if rest:
        yield Piece(rest, first=False, continues=False)


def _decoded_chunks(path: Path, chunk_bytes: int):
    """The file's text in chunks of at most `chunk_bytes` bytes (a line longer than that in several), decoded strictly
    as UTF-8 across chunk boundaries; errors are one line naming the file (and line), as utf8_lines words them."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    line = 1
    try:
        with open_binary(path) as f:
            while raw := f.readline(chunk_bytes):
                try:
                    yield decoder.decode(raw)
                except UnicodeDecodeError as err:
                    raise UserError(
                        f"{path}:{line} is not UTF-8 text (byte 0x{raw[err.start]:02x}); save the file as UTF-8"
                    ) from None
                line += raw.endswith(b"\n")
            decoder.decode(b"", final=True)
    except UserError:
        raise
    except UnicodeDecodeError:
        raise UserError(f"{path} ends inside a UTF-8 character; save the file as UTF-8") from None
    except Exception as err:  # a truncated or corrupt compressed stream
        if compression_of(path) is None:
            raise
        detail = str(err).splitlines()[0][:100] if str(err) else "end of stream"
        raise UserError(f"{path} is truncated or corrupt ({type(err).__name__}: {detail}); download it again") from None
