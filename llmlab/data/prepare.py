"""The data pipeline, streaming: source -> cleaning -> exact and near dedup -> tokenisation -> token shards.

    cfg = DataConfig(block_size=256)
    data = prepare_dataset(cfg)          # data.train / data.validation: blocks of 256 ids over memory-mapped shards
    print(format_prepare_summary(data.report))

Documents flow one batch at a time, cleaned, tokenised and MinHashed by `num_proc` worker processes in corpus
order, so the corpus is never held in memory. Three passes, each resumable after a kill:
1. stage: every document that is not an exact duplicate has its tokens appended to staging shards (cut at a
   document boundary every `shard_tokens`) and its LSH band keys to stage/bands.bin, each shard followed by a
   checkpoint (documents read, token counts, the Bloom filter);
2. near-dup (llmlab.data.near_dup): candidate pairs from the band keys, confirmed by exact Jaccard, clustered;
   all but each cluster's first document are dropped;
3. pack: the seeded whole-document train/validation split of the remaining documents (packing.split_documents,
   on the token counts alone), then each split's documents, in that order, into fixed-size shards
   (llmlab.data.shards) holding exactly its full blocks.
The manifest is written last; only a folder with one is used, and a killed preparation resumes where it stopped.
The output is the same blocks the earlier in-memory pipeline made, so runs on the small builtin corpus are unchanged.
Memory: a fixed base (the Bloom filter, one batch per worker) plus about 24 bytes per document (token counts, the
split's order, and one band's keys while near-dup sorts them); bench/data_scale.py measures it.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import re
import shutil
import signal
import sys
import time
import zlib
from array import array
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
from filelock import FileLock

from llmlab.core.config import opt
from llmlab.core.device import available_cores
from llmlab.core.errors import UserError
from llmlab.core.io import atomic_write_json, llmlab_cache, progress_bar
from llmlab.data import cleaning, corpus, minhash, near_dup
from llmlab.data.packing import split_documents
from llmlab.data.shards import MANIFEST, ShardWriter, TokenBlocks, token_dtype, write_manifest
from llmlab.data.tokenizer import fast_gpt2_encoder, is_builtin_gpt2, load_tokenizer

PIPELINE_VERSION = 4  # 2: streaming into token shards (same blocks as version 1); 3: near-dup in stages on disk;
# 4: a document longer than corpus.MAX_DOCUMENT_CHARS stays one document (its pieces had an eos each), and near-dup
# confirms each run of equal band keys against its first member too
STATE = "state.json"
BLOOM = "bloom.zlib"
BATCH_DOCUMENTS = 256  # documents per worker task: large enough for the tokenizer's batch speed
# ... and at most this many characters: a batch of 256 long documents' 200k-character pieces held ~1.2 GB across the
# workers and the batches in flight (bench/one_document.py), one of typical documents holds about a million
BATCH_CHARACTERS = 2_000_000


def default_data_cache() -> str:
    return str(llmlab_cache("data"))


@dataclass
class DataConfig:
    dataset: str = opt(
        "builtin:wiki",
        "corpus: builtin:wiki (offline Wikipedia sample), a hub dataset name, "
        "or local .txt/.jsonl/.parquet files or a folder",
    )
    dataset_config: Optional[str] = opt(None, "hub dataset configuration, e.g. wikitext-103-raw-v1")
    text_field: str = opt("text", "JSONL field / parquet or hub column holding the document text")
    tokenizer: Optional[str] = opt(None, "tokenizer name or path; default: the offline GPT-2 BPE")
    block_size: int = opt(1024, "tokens per packed training block (every block is exactly this long)")
    min_doc_chars: int = opt(50, "drop documents shorter than this many characters after cleaning")
    near_dup_threshold: float = opt(
        0.85,
        "MinHash Jaccard similarity at or above which a document counts as a "
        "near-duplicate of an earlier one and is dropped; 0 disables",
    )
    num_proc: int = opt(
        0,
        "worker processes for cleaning, MinHash and tokenisation (0: one per available core, and one for a "
        f"--max_documents of {BATCH_DOCUMENTS} or fewer)",
    )
    val_fraction: float = opt(0.05, "share of tokens held out for validation (whole documents, seeded); 0 = none")
    data_seed: int = opt(1234, "seed of the document shuffle behind the train/validation split")
    cache_dir: str = opt(default_data_cache(), "folder for prepared (packed, tokenised) datasets")
    max_documents: Optional[int] = opt(None, "use only the first N documents of the source (quick runs)")
    shard_tokens: int = opt(
        100_000_000, "tokens per token shard (llm.c's size): a killed preparation resumes from its last complete shard"
    )
    dedup_memory_mb: int = opt(
        128,
        "memory of the exact-duplicate Bloom filter, fixed whatever the corpus size "
        "(128 MB: a unique document is wrongly dropped with p < 1e-6 up to 10M documents)",
    )
    verify_shards: bool = opt(
        True,
        "check every token shard's sha256 before using it (a corrupt shard is named and refused; about 1 s per GB)",
    )

    def validate(self) -> None:
        if self.block_size < 2:
            raise UserError(f"--block_size must be at least 2, got {self.block_size}")
        if self.min_doc_chars < 0:
            raise UserError(f"--min_doc_chars must be >= 0, got {self.min_doc_chars}")
        if not 0 <= self.near_dup_threshold <= 1:
            raise UserError(f"--near_dup_threshold must be in [0, 1] (0 disables), got {self.near_dup_threshold}")
        if self.num_proc < 0:
            raise UserError(f"--num_proc must be >= 0 (0 = one per available core), got {self.num_proc}")
        if self.shard_tokens < self.block_size:
            raise UserError(f"--shard_tokens must be at least --block_size {self.block_size}, got {self.shard_tokens}")
        if self.dedup_memory_mb < 1:
            raise UserError(f"--dedup_memory_mb must be >= 1, got {self.dedup_memory_mb}")
        if not 0 <= self.val_fraction < 1:
            raise UserError(f"--val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.max_documents is not None and self.max_documents < 1:
            raise UserError(f"--max_documents must be >= 1 (or omitted), got {self.max_documents}")


@dataclass
class PreparedData:
    train: Any  # TokenBlocks: len() blocks, [i] -> {"input_ids": tensor of block_size ids}
    validation: Any  # same; zero blocks when val_fraction is 0
    report: dict
    cache_path: Path


def prepare_dataset(cfg: DataConfig, tokenizer=None) -> PreparedData:
    """Train/validation blocks for `cfg`, prepared once into token shards and reused while nothing they depend on
    changed; a preparation killed half-way resumes."""
    start = time.perf_counter()
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.tokenizer)
        tokenizer_label = cfg.tokenizer or "gpt2 (offline BPE)"
    else:
        tokenizer_label = tokenizer.name_or_path
    check_tokenizer(tokenizer, cfg.block_size)
    key_inputs = cache_key_inputs(cfg, tokenizer)
    cache_path = Path(cfg.cache_dir).expanduser() / cache_name(cfg, key_inputs)
    cache_hit = (cache_path / MANIFEST).is_file()
    if not cache_hit:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(cache_path.with_name(cache_path.name + ".lock"))):  # one builder per corpus; others wait
            if not (cache_path / MANIFEST).is_file():
                _build(cfg, tokenizer, tokenizer_label, key_inputs, cache_path, start)
    manifest = json.loads((cache_path / MANIFEST).read_text())
    train = TokenBlocks(cache_path, "train", cfg.block_size, cfg.verify_shards, manifest)
    validation = TokenBlocks(cache_path, "validation", cfg.block_size, cfg.verify_shards, manifest)
    report = {
        **manifest["report"],
        "cache_hit": cache_hit,
        "cache_path": str(cache_path),
        "seconds": round(time.perf_counter() - start, 3),
    }
    return PreparedData(train, validation, report, cache_path)


def check_tokenizer(tokenizer, block_size: int) -> None:
    if tokenizer.eos_token_id is None:
        raise UserError(f"tokenizer {tokenizer.name_or_path!r} has no eos token; pick a tokenizer that defines one")
    max_len = getattr(tokenizer, "model_max_length", None)
    if max_len is not None and block_size > max_len:
        raise UserError(
            f"--block_size {block_size} is larger than the tokenizer's model_max_length {max_len}; "
            f"pass --block_size {max_len} or less"
        )


def tokenizer_identity(tokenizer) -> str:
    """A hash of the tokenizer's full definition (vocab, merges, normaliser), not just its name."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = json.loads(backend.to_str())
        for call_state in ("truncation", "padding"):  # set per call by transformers; not part of the vocabulary
            definition.pop(call_state, None)
        text = json.dumps(definition, sort_keys=True)
    else:
        text = json.dumps([type(tokenizer).__name__, tokenizer.name_or_path, len(tokenizer)])
    return hashlib.sha256(f"{text}|eos={tokenizer.eos_token_id}".encode()).hexdigest()[:16]


def cache_key_inputs(cfg: DataConfig, tokenizer) -> dict:
    return {
        "pipeline_version": PIPELINE_VERSION,
        "source": corpus.source_fingerprint(cfg.dataset, cfg.dataset_config, cfg.text_field),
        "max_documents": cfg.max_documents,
        "cleaning": {
            "version": cleaning.CLEANING_VERSION,
            "min_doc_chars": cfg.min_doc_chars,
            "near_dup_threshold": cfg.near_dup_threshold,
            "near_dup": {
                "num_perm": minhash.NUM_PERM,
                "bands": minhash.BANDS,
                "rows": minhash.ROWS,
                "shingle_words": minhash.SHINGLE_WORDS,
            },
        },
        "tokenizer": tokenizer_identity(tokenizer),
        "block_size": cfg.block_size,
        "val_fraction": cfg.val_fraction,
        "data_seed": cfg.data_seed,
    }


def cache_name(cfg: DataConfig, key_inputs: dict) -> str:
    digest = hashlib.sha256(json.dumps(key_inputs, sort_keys=True).encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9]+", "-", Path(cfg.dataset.rstrip("/")).name).strip("-")[:40] or "data"
    return f"{stem}-b{cfg.block_size}-{digest}"


def _build(cfg: DataConfig, tokenizer, tokenizer_label: str, key_inputs: dict, cache_path: Path, start: float) -> None:
    """Stage, then pack, then the manifest (last). Either pass picks up where a killed run left it."""
    cache_path.mkdir(parents=True, exist_ok=True)
    stage = cache_path / "stage"
    stage.mkdir(exist_ok=True)
    dtype = token_dtype(len(tokenizer))
    try:
        state = _read_state(stage)
        if not state.get("staged_all"):
            state = _stage(cfg, tokenizer, stage, state, dtype)
        removed = _near_duplicates(cfg, tokenizer, stage, state, dtype)
        report = _pack(cfg, cache_path, stage, state, dtype, removed)
        report.update(
            dataset=cfg.dataset,
            dataset_config=cfg.dataset_config,
            tokenizer=tokenizer_label,
            block_size=cfg.block_size,
            num_proc=_workers(cfg),
            steps=state["steps"],
            characters_loaded=state["characters_loaded"],
            dedup=state["dedup"],
            stage_seconds=state["seconds"],
            tokenize_seconds=state["seconds"]["stage"],
            cache_key=key_inputs,
            dtype=str(dtype),
            bytes_per_token=dtype.itemsize,
        )
        report["tokenize_tokens_per_second"] = round(report["tokens"] / max(state["seconds"]["stage"], 1e-9), 1)
        report["prepare_seconds"] = round(time.perf_counter() - start, 3)
        report["documents_per_second"] = round(state["steps"][0]["in"] / max(report["prepare_seconds"], 1e-9), 2)
        report["tokens_per_second"] = round(report["tokens"] / max(report["prepare_seconds"], 1e-9), 1)
        pack = json.loads((stage / "pack.json").read_text())
        write_manifest(
            cache_path,
            {
                "pipeline_version": PIPELINE_VERSION,
                "dtype": dtype.str,
                "key": key_inputs,
                "splits": pack["splits"],
                "report": report,
            },
        )
    except OSError as err:
        full = err.errno == 28 or "No space left" in str(err)
        raise UserError(
            f"could not write the token shards in {cache_path}: "
            f"{'the disk is full' if full else str(err).splitlines()[0][:160]}; free space (or pass "
            "another --cache_dir) and run again: the preparation resumes from its last complete shard"
        ) from None
    shutil.rmtree(stage, ignore_errors=True)


def _workers(cfg: DataConfig) -> int:
    """--num_proc, or one process per core but no more than there are batches of --max_documents: a pool for a
    corpus of one batch only adds its start (every worker builds the BPE): 0.8 s of a 5-document --prepare_only's 8.6 s
    (bench/startup.py)."""
    if cfg.num_proc:
        return cfg.num_proc
    cores = available_cores()
    return min(cores, math.ceil(cfg.max_documents / BATCH_DOCUMENTS)) if cfg.max_documents else cores


def _read_state(stage: Path) -> dict:
    path = stage / STATE
    return json.loads(path.read_text()) if path.is_file() else {}


class Dedup:
    """Exact duplicates by a Bloom filter over the cleaned text's hash (fixed memory whatever the corpus size); for
    near duplicates, each staged document's LSH band keys appended to stage/bands.bin (near_dup finds the pairs
    after staging). Both survive a kill: the Bloom bits and the keys file are checkpointed with each staging shard,
    and a resume cuts the keys file back to the documents its checkpoint staged."""

    HASHES = 7

    def __init__(self, cfg: DataConfig, stage: Path, state: dict, staged: int):
        self.bits = cfg.dedup_memory_mb * 8 * 2**20
        self.bloom = _load_bloom(stage / BLOOM) if state else np.zeros(self.bits // 8, dtype=np.uint8)
        self.threshold, self.stage = cfg.near_dup_threshold, stage
        self.bands = None
        if self.threshold:
            self.bands = open(stage / near_dup.BANDS_FILE, "ab")
            self.bands.truncate(staged * minhash.BANDS * 8)  # drop what a killed run wrote after its checkpoint

    def seen_exact(self, digest: bytes) -> bool:
        """Whether this hash was (probably) seen before; records it either way."""
        h1, h2 = int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:16], "little") | 1
        positions = [(h1 + i * h2) % self.bits for i in range(self.HASHES)]
        seen = all(self.bloom[p >> 3] & (1 << (p & 7)) for p in positions)
        for p in positions:
            self.bloom[p >> 3] |= 1 << (p & 7)
        return seen

    def add_bands(self, keys: list[np.ndarray]) -> None:
        if self.bands is not None and keys:
            self.bands.write(np.stack(keys).astype(np.uint64).tobytes())

    def checkpoint(self) -> None:
        _save_bloom(self.stage / BLOOM, self.bloom)
        if self.bands is not None:
            self.bands.flush()
            os.fsync(self.bands.fileno())

    def false_positive_rate(self, documents: int) -> float:
        return (1 - math.exp(-self.HASHES * documents / self.bits)) ** self.HASHES


def _save_bloom(path: Path, bloom: np.ndarray) -> None:
    """Compressed (nearly all zeros on a small corpus) in 1 MB views of the array: savez_compressed went through 16
    MB copies that stayed in the heap after every checkpoint. Atomic like _save_npy."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            packer = zlib.compressobj(1)
            for start in range(0, len(bloom), 1 << 20):
                handle.write(packer.compress(bloom[start : start + (1 << 20)]))
            handle.write(packer.flush())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _load_bloom(path: Path) -> np.ndarray:
    return np.frombuffer(zlib.decompress(path.read_bytes()), dtype=np.uint8).copy()


def _save_npy(path: Path, array: np.ndarray) -> None:
    """Atomically: a temp file, fsync, rename; the temp file is removed if the write fails (a full disk)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            np.save(handle, array)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _stage(cfg: DataConfig, tokenizer, stage: Path, state: dict, dtype) -> dict:
    """Pass 1: documents -> clean -> dedup -> tokens in staging shards, checkpointed every `shard_tokens`."""
    started = time.perf_counter()
    state = state or {
        "read": 0,
        "lengths": 0,
        "shards": [],
        "characters_loaded": 0,
        "loaded": 0,
        "short": 0,
        "exact": 0,
        "seconds": {},
        "min_doc_chars": cfg.min_doc_chars,
    }
    for orphan in stage.glob("doc_*.bin"):  # written after the last checkpoint by a killed run: redone below
        if orphan.name not in {r["file"] for r in state["shards"]}:
            orphan.unlink()
    lengths = array("q", np.load(stage / "lengths.npy") if state["shards"] else [])  # 8 bytes a document
    joins = array("b", _joins(stage, len(lengths)) if state["shards"] else [])  # a piece that continues its document
    dedup = Dedup(cfg, stage, state if state["shards"] else {}, len(lengths))
    writer = ShardWriter(stage, "doc", dtype, shard_tokens=1 << 62, start_index=len(state["shards"]))
    source = corpus.iter_documents(cfg.dataset, cfg.dataset_config, cfg.text_field)
    source = itertools.islice(source, state["read"], cfg.max_documents)
    wikitext = cfg.dataset == corpus.BUILTIN_WIKI
    with _progress("documents", state["read"]) as bar, _aborting(writer):  # the bar's line ends before an error
        for results in _map_batches(cfg, tokenizer, wikitext, source):
            kept, keys = [], []
            for raw_chars, digest, band_keys, tokens, piece, continues in results:
                state["read"] += 1
                state["characters_loaded"] += raw_chars
                if tokens is None:
                    state["short"] += 1
                elif not piece and dedup.seen_exact(digest):  # a piece is part of a document, never one itself
                    state["exact"] += 1
                else:
                    kept.append(tokens)
                    keys.append(band_keys if not piece else _piece_keys(len(lengths) + len(kept) - 1))
                    joins.append(continues)
            if kept:  # one write per batch
                writer.add(np.concatenate(kept))
                lengths.extend(len(t) for t in kept)
                dedup.add_bands(keys)
            if writer.in_shard >= cfg.shard_tokens:  # a checkpoint at this batch's end, a document boundary
                _checkpoint(stage, state, writer.close(), lengths, dedup, joins)
            bar.update(len(results))
    if not lengths and not writer.in_shard:
        loaded = state["read"]
        raise UserError(
            f"corpus {cfg.dataset} is empty after cleaning ({loaded} documents loaded, none with "
            f">= {cfg.min_doc_chars} characters); pass more text or lower --min_doc_chars"
        )
    state["staged_all"] = True
    state["seconds"]["stage"] = round(state["seconds"].get("stage", 0) + time.perf_counter() - started, 3)
    _checkpoint(stage, state, writer.close(), lengths, dedup, joins)
    return state


def _piece_keys(staged_id: int) -> np.ndarray:
    """LSH band keys no other staged document has (a hash of the piece's staged id): a piece of a long document is
    never a near-duplicate candidate, so near-dup never reads a long document whole."""
    key = int.from_bytes(hashlib.blake2b(b"piece:%d" % staged_id, digest_size=8).digest(), "little")
    return np.full(minhash.BANDS, key, dtype=np.uint64)


def _joins(stage: Path, staged: int) -> np.ndarray:
    """Whether each staged entry continues into the next (pieces of one document); none in a stage from before."""
    path = stage / "joins.npy"
    return np.load(path) if path.is_file() else np.zeros(staged, dtype=np.int8)


def _checkpoint(stage: Path, state: dict, sealed: list[dict], lengths: array, dedup: Dedup, joins: array) -> None:
    """Everything a resume needs, the state file last (it names what is valid)."""
    state["shards"] += sealed
    _save_npy(stage / "lengths.npy", np.asarray(lengths, dtype=np.int64))
    _save_npy(stage / "joins.npy", np.asarray(joins, dtype=np.int8))
    dedup.checkpoint()
    state["staged"] = len(lengths)
    state["dedup"] = {
        "bloom_mb": dedup.bits / 8 / 2**20,
        "bloom_false_positive_rate": dedup.false_positive_rate(state["read"] - state["short"]),
        "near_dup_threshold": dedup.threshold,
    }
    atomic_write_json(stage / STATE, state)


def _near_duplicates(cfg: DataConfig, tokenizer, stage: Path, state: dict, dtype) -> np.ndarray:
    """The staged documents that near_dup drops (none when it is off), and the cleaning steps' counts."""
    removed = np.zeros(0, dtype=np.int64)
    if cfg.near_dup_threshold:
        started = time.perf_counter()
        lengths = np.load(stage / "lengths.npy")
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        staged = _staged_tokens(stage, state, dtype)
        decode = _decoder(tokenizer)
        text_of = lambda i: decode(staged.window(int(offsets[i]), int(offsets[i + 1]) - 1).tolist())  # noqa: E731
        removed = near_dup.find(stage, len(lengths), cfg.near_dup_threshold, text_of, _save_npy)
        staged.close()
        disk = near_dup.disk_bytes(stage)
        state["dedup"]["near_dup_disk_bytes"] = disk
        state["dedup"]["near_dup_disk_bytes_per_document"] = round(disk / max(len(lengths), 1), 1)
        state["seconds"].setdefault("near_dup", round(time.perf_counter() - started, 3))
    read, short, staged_docs = state["read"], state["short"], state["staged"]
    threshold = cfg.near_dup_threshold
    state["steps"] = [
        {"step": "loaded", "in": read, "out": read},
        _step(f"shorter than {state['min_doc_chars']} chars", read, read - short),
        _step("exact duplicates", read - short, staged_docs),
        _step(
            f"near duplicates (Jaccard >= {threshold})" if threshold else "near duplicates (disabled)",
            staged_docs,
            staged_docs - len(removed),
        ),
    ]
    return removed


def _staged_tokens(stage: Path, state: dict, dtype) -> TokenBlocks:
    """The staged documents' tokens, read (not memory-mapped: one pass would keep every page resident)."""
    manifest = {"dtype": dtype.str, "splits": {"staged": state["shards"]}}
    return TokenBlocks(stage, "staged", 1, manifest=manifest, mapped=False)


def _decoder(tokenizer):
    """ids -> the cleaned text they were made from (byte-level BPE decodes exactly)."""
    if is_builtin_gpt2(tokenizer):
        return fast_gpt2_encoder().decode
    return lambda ids: tokenizer.decode(ids, clean_up_tokenization_spaces=False)


@contextmanager
def _aborting(writer: ShardWriter):
    """A failed or interrupted pass leaves no half-written shard file behind (a full disk, Ctrl-C)."""
    try:
        yield
    except BaseException:
        writer.abort()
        raise


def _progress(unit: str, initial: int):
    return progress_bar(desc="Preparing", unit=unit, initial=initial)


def _map_batches(cfg: DataConfig, tokenizer, wikitext: bool, source):
    """Per-document results in corpus order, computed by `num_proc` processes (here when 1)."""
    batches = _batches(source)
    options = (tokenizer, wikitext, cfg.min_doc_chars, cfg.near_dup_threshold > 0)
    workers = _workers(cfg)
    if workers == 1:
        _init_worker(*options)
        yield from map(_process_batch, batches)
        return
    context = multiprocessing.get_context("spawn" if sys.platform != "linux" else "fork")
    # Frozen, the objects the workers inherit are never visited by a collection in them: a full collection writes
    # to every object's header, so each worker's copy-on-write pages became its own partway through a corpus (the
    # process tree's memory stepped up by ~100 MB at 1 GB of text, never at small sizes).
    gc.freeze()
    try:
        with context.Pool(workers, initializer=_init_pool_worker, initargs=options) as pool:
            yield from pool.imap(_process_batch, batches, chunksize=1)
    finally:
        gc.unfreeze()


def _batches(source):
    """Lists of documents in corpus order, each of at most BATCH_DOCUMENTS documents and about BATCH_CHARACTERS."""
    batch, characters = [], 0
    for text in source:
        batch.append(text)
        characters += len(text)
        if len(batch) >= BATCH_DOCUMENTS or characters >= BATCH_CHARACTERS:
            yield batch
            batch, characters = [], 0
    if batch:
        yield batch


_WORKER: dict = {}


def _init_pool_worker(*options) -> None:
    # A forked worker inherits its parent's Python signal handlers. Pool.terminate ends workers with SIGTERM, so one
    # that caught it and went on (Ray's driver installs such a handler) kept the pool's join waiting forever.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _init_worker(*options)


def _init_worker(tokenizer, wikitext: bool, min_chars: int, near: bool) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    # A document's text is only text: a literal "<|endoftext|>" in it is never the eos token (split_special_tokens)
    if is_builtin_gpt2(tokenizer):  # same ids, 5.6x faster: tiktoken over the shipped GPT-2 files
        fast = fast_gpt2_encoder()
        encode = lambda texts: fast.encode_ordinary_batch(texts, num_threads=1)  # noqa: E731
    else:
        encode = lambda texts: tokenizer(  # noqa: E731
            texts, add_special_tokens=False, return_attention_mask=False, split_special_tokens=True, verbose=False
        )["input_ids"]
    _WORKER.update(encode=encode, eos=tokenizer.eos_token_id, wikitext=wikitext, min_chars=max(min_chars, 1), near=near)


def _process_batch(texts: list[str]) -> list[tuple]:
    """(raw characters, hash, LSH band keys if near-dup is on, tokens (+ eos) or None if short, whether the text is a
    piece of a longer document, whether more of its document follows) per text. A piece (corpus.Piece) is never
    short and ends in eos only if it ends its document: the pieces pack as the one document they are."""
    raw = [len(t) for t in texts]
    pieces = [isinstance(t, corpus.Piece) for t in texts]
    starts = [not piece or t.first for piece, t in zip(pieces, texts)]
    ends = [not piece or not t.continues for piece, t in zip(pieces, texts)]
    if _WORKER["wikitext"]:
        from gensim.corpora.wikicorpus import filter_wiki  # removes templates, links, tables, refs

        texts = [filter_wiki(t) for t in texts]
    cleaned = [cleaning.clean_text(t, start, end) for t, start, end in zip(texts, starts, ends)]
    long = [i for i, t in enumerate(cleaned) if len(t) >= _WORKER["min_chars"] or pieces[i]]
    ids = _WORKER["encode"]([cleaned[i] for i in long]) if long else []
    tokens: list = [None] * len(texts)
    for i, doc in zip(long, ids):
        tokens[i] = np.asarray(doc + [_WORKER["eos"]] if ends[i] else doc, dtype=np.uint32)
    keys: list = [None] * len(texts)
    whole = [i for i in long if not pieces[i]]  # a piece's keys are its staged id's own (prepare._piece_keys)
    if _WORKER["near"] and whole:
        for i, row in zip(whole, minhash.band_keys(minhash.signatures([cleaned[i] for i in whole]))):
            keys[i] = row
    return [
        (
            raw[i],
            hashlib.blake2b(cleaned[i].encode("utf-8"), digest_size=16).digest(),
            keys[i],
            tokens[i],
            pieces[i],
            not ends[i],
        )
        for i in range(len(texts))
    ]


def _pack(cfg: DataConfig, cache_path: Path, stage: Path, state: dict, dtype, removed: np.ndarray) -> dict:
    """Pass 3: the seeded split of the documents near-dup kept, then each split's documents into fixed-size shards
    of its full blocks."""
    # long: 61 lines once ruff's layout puts its long calls one argument a line; one step, read top to bottom
    started = time.perf_counter()
    lengths = np.load(stage / "lengths.npy")
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    staged = _staged_tokens(stage, state, dtype)
    kept = _kept_documents(len(lengths), removed)
    starts = _document_starts(kept, _joins(stage, len(lengths)))  # a long document's pieces are one document
    train_groups, val_groups = split_documents(np.add.reduceat(lengths[kept], starts), cfg.val_fraction, cfg.data_seed)
    train_docs, val_docs = _entries(kept, starts, train_groups), _entries(kept, starts, val_groups)
    kept_tokens = int(lengths[kept].sum())
    bs = cfg.block_size
    train_tokens = int(lengths[train_docs].sum()) // bs * bs
    val_tokens = int(lengths[val_docs].sum()) // bs * bs
    split = "whole documents"
    if train_tokens == 0 or (cfg.val_fraction > 0 and val_tokens == 0):
        # too few documents to split whole (e.g. one .txt file): split the text itself, and say so
        n_blocks = kept_tokens // bs
        n_val = max(1, round(cfg.val_fraction * n_blocks)) if cfg.val_fraction > 0 else 0
        if n_blocks - n_val < 1:
            _too_small(cfg, kept_tokens, len(starts), state)
        train_tokens, val_tokens = (n_blocks - n_val) * bs, n_val * bs
        plans = {"train": (kept, 0, train_tokens), "validation": (kept, train_tokens, val_tokens)}
        split = "within the text"
        print(
            f"note: {len(kept)} document(s) cannot fill both splits with whole documents; the last {n_val} of "
            f"{n_blocks} blocks of the text are the validation split",
            flush=True,
        )
    else:
        plans = {"train": (train_docs, 0, train_tokens), "validation": (val_docs, 0, val_tokens)}
    if train_tokens == 0:
        raise UserError(
            f"{kept_tokens} tokens make {kept_tokens // bs} block(s) of --block_size {bs}: not "
            "enough to train on after holding out validation; lower --block_size, add text or lower "
            "--val_fraction"
        )
    progress_path = stage / "pack.json"
    done = json.loads(progress_path.read_text()) if progress_path.is_file() else {"splits": {}}
    for name, (docs, skip, total) in plans.items():
        records = done["splits"].setdefault(name, [])
        for orphan in cache_path.glob(f"{name}_*.bin"):
            if orphan.name not in {r["file"] for r in records}:
                orphan.unlink()
        writer = ShardWriter(cache_path, name, dtype, cfg.shard_tokens, start_index=len(records))
        written = sum(r["tokens"] for r in records)
        with _aborting(writer):
            for chunk in _token_stream(staged, lengths, offsets, docs, skip + written, skip + total):
                for record in writer.add(chunk):
                    records.append(record)
                    atomic_write_json(progress_path, done)
            records += writer.close()
        atomic_write_json(progress_path, done)
    staged.close()
    state["seconds"]["pack"] = round(time.perf_counter() - started, 3)
    return {
        "split": split,
        "documents": len(starts),
        "train_documents": len(train_groups) if split == "whole documents" else None,
        "validation_documents": len(val_groups) if split == "whole documents" else None,
        "tokens": kept_tokens,
        "train_tokens": train_tokens,
        "validation_tokens": val_tokens,
        "dropped_tail_tokens": kept_tokens - train_tokens - val_tokens,
        "train_blocks": train_tokens // bs,
        "validation_blocks": val_tokens // bs,
    }


def _too_small(cfg: DataConfig, tokens: int, documents: int, state: dict) -> None:
    """The real reason a corpus cannot train, in one line: its tokens, its blocks and what to pass."""
    splits = 2 if cfg.val_fraction > 0 else 1
    fits, needs = tokens // splits, "train and validation" if splits == 2 else "train"
    fix = f"lower --block_size to {fits} or less" if fits >= 2 else "add text"
    raise UserError(
        f"the corpus holds {tokens:,} tokens in {documents:,} document(s) after cleaning and deduplication "
        f"({state['read']:,} loaded, {state['exact']:,} exact duplicates): {tokens // cfg.block_size} block(s) of "
        f"--block_size {cfg.block_size}, and a run needs {splits} ({needs})"
        f"; {fix}" + (", or --val_fraction 0" if splits == 2 else "")
    )


def _document_starts(kept: np.ndarray, joins: np.ndarray) -> np.ndarray:
    """Positions in `kept` where a document starts: every entry, but a piece that continues the one before it."""
    if not len(kept):
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.concatenate([[True], joins[kept[:-1]] == 0]))


def _entries(kept: np.ndarray, starts: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """The staged ids of documents `groups` (indices into `starts`), in that order, each document's pieces in order."""
    if len(starts) == len(kept):  # no long document: one entry each
        return kept[groups]
    ends = np.append(starts[1:], len(kept))
    sizes = ends[groups] - starts[groups]
    first = np.repeat(starts[groups], sizes)
    within = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    return kept[first + within]


def _kept_documents(staged: int, removed: np.ndarray) -> np.ndarray:
    """Staged ids not removed, ascending (corpus order), built through a 1-byte mask rather than set operations."""
    if not len(removed):
        return np.arange(staged)
    keep = np.ones(staged, dtype=bool)
    keep[removed] = False
    return np.flatnonzero(keep)


def _token_stream(
    staged: TokenBlocks,
    lengths: np.ndarray,
    offsets: np.ndarray,
    docs: np.ndarray,
    start: int,
    stop: int,
    chunk: int = 1 << 22,
):
    """Tokens [start, stop) of the documents `docs` concatenated in that order, in chunks of about `chunk`."""
    doc_lengths = lengths[docs]
    ends = np.cumsum(doc_lengths)
    position, k = start, int(np.searchsorted(ends, start, side="right"))
    buffer, size = [], 0
    while position < stop and k < len(docs):
        doc_start = int(ends[k] - doc_lengths[k])
        begin, end = position - doc_start, min(int(doc_lengths[k]), stop - doc_start)
        piece = staged.window(int(offsets[docs[k]]) + begin, int(offsets[docs[k]]) + end)
        buffer.append(piece)
        size += len(piece)
        position = doc_start + end
        k += 1
        if size >= chunk:
            yield np.concatenate(buffer)
            buffer, size = [], 0
    if buffer:
        yield np.concatenate(buffer)


def _step(name: str, before: int, after: int) -> dict:
    return {"step": name, "in": before, "out": after}


def format_prepare_summary(report: dict) -> str:
    """The human-readable summary that `train_pretrain.py --prepare_only` prints."""
    lines = [
        f"dataset {report['dataset']}"
        + (f" ({report['dataset_config']})" if report.get("dataset_config") else "")
        + f", tokenizer {report['tokenizer']}, block_size {report['block_size']}"
    ]
    lines.append(f"{'cleaning step':<42}{'docs in':>10}{'docs out':>10}{'removed':>10}")
    for step in report["steps"]:
        lines.append(f"{step['step']:<42}{step['in']:>10}{step['out']:>10}{step['in'] - step['out']:>10}")
    if report.get("split", "whole documents") == "whole documents":
        lines.append(
            f"documents kept: {report['documents']} (train {report['train_documents']}, "
            f"validation {report['validation_documents']})"
        )
    else:
        lines.append(f"documents kept: {report['documents']}, split within the text (too few to split whole)")
    lines.append(
        f"tokens: {report['tokens']:,} (incl. one eos per document); dropped tail remainder: "
        f"{report['dropped_tail_tokens']:,}"
    )
    lines.append(
        f"blocks of {report['block_size']}: train {report['train_blocks']:,}, "
        f"validation {report['validation_blocks']:,}"
    )
    lines.append(
        f"tokenisation: {report['tokenize_tokens_per_second']:,.0f} tokens/s "
        f"({report['tokenize_seconds']:.2f} s, num_proc {report['num_proc']}); whole preparation "
        f"{report['prepare_seconds']:.2f} s, {report['documents_per_second']:,.1f} documents/s, "
        f"{report['tokens_per_second']:,.0f} tokens/s"
    )
    if report.get("stage_seconds"):
        lines.append("seconds per stage: " + ", ".join(f"{k} {v:.2f}" for k, v in report["stage_seconds"].items()))
    origin = "reused from cache" if report.get("cache_hit") else "written to cache"
    lines.append(f"{origin}: {report.get('cache_path', '?')}")
    return "\n".join(lines)
