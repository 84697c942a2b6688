"""The data pipeline: corpus -> cleaning -> tokenisation -> packed fixed-length blocks -> Arrow cache.

    cfg = DataConfig(block_size=256)
    data = prepare_dataset(cfg)          # data.train / data.validation: column "input_ids", rows of 256 ids
    print(format_prepare_summary(data.report))

The packed splits are saved with `datasets.save_to_disk` under `cache_dir/<name>-<hash>`, where the
hash covers everything that changes the output (source and file stats, cleaning parameters, tokenizer
content, block size, split parameters). Later calls load them memory-mapped. A cache folder is built
under a temp name, gets its COMPLETE marker last, and is renamed into place, so a preparation killed
half-way never leaves a folder that loads as valid.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from llmlab.core.config import opt
from llmlab.core.errors import UserError
from llmlab.core.io import atomic_write_json, atomic_write_text, llmlab_cache
from llmlab.data import cleaning, corpus
from llmlab.data.packing import blocks_dataset, pack_blocks, split_documents, split_within
from llmlab.data.tokenizer import load_tokenizer

COMPLETE_MARKER = "COMPLETE"
PIPELINE_VERSION = 1  # bump when packing/splitting output changes


def default_data_cache() -> str:
    return str(llmlab_cache("data"))


@dataclass
class DataConfig:
    dataset: str = opt("builtin:wiki", "corpus: builtin:wiki (offline Wikipedia sample), a hub dataset name, "
                                       "or local .txt/.jsonl/.parquet files or a folder")
    dataset_config: Optional[str] = opt(None, "hub dataset configuration, e.g. wikitext-103-raw-v1")
    text_field: str = opt("text", "JSONL field / parquet or hub column holding the document text")
    tokenizer: Optional[str] = opt(None, "tokenizer name or path; default: the offline GPT-2 BPE")
    block_size: int = opt(1024, "tokens per packed training block (every block is exactly this long)")
    min_doc_chars: int = opt(50, "drop documents shorter than this many characters after cleaning")
    near_dup_threshold: float = opt(0.85, "MinHash Jaccard similarity at or above which a document counts as a "
                                          "near-duplicate of an earlier one and is dropped; 0 disables")
    num_proc: int = opt(1, "worker processes for cleaning, MinHash and tokenisation")
    val_fraction: float = opt(0.05, "share of tokens held out for validation (whole documents, seeded); 0 = none")
    data_seed: int = opt(1234, "seed of the document shuffle behind the train/validation split")
    cache_dir: str = opt(default_data_cache(), "folder for prepared (packed, tokenised) datasets")
    max_documents: Optional[int] = opt(None, "use only the first N documents of the source (quick runs)")

    def validate(self) -> None:
        if self.block_size < 2:
            raise UserError(f"--block_size must be at least 2, got {self.block_size}")
        if self.min_doc_chars < 0:
            raise UserError(f"--min_doc_chars must be >= 0, got {self.min_doc_chars}")
        if not 0 <= self.near_dup_threshold <= 1:
            raise UserError(f"--near_dup_threshold must be in [0, 1] (0 disables), got {self.near_dup_threshold}")
        if self.num_proc < 1:
            raise UserError(f"--num_proc must be >= 1, got {self.num_proc}")
        if not 0 <= self.val_fraction < 1:
            raise UserError(f"--val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.max_documents is not None and self.max_documents < 1:
            raise UserError(f"--max_documents must be >= 1 (or omitted), got {self.max_documents}")


@dataclass
class PreparedData:
    train: Any  # datasets.Dataset, column "input_ids", each row exactly block_size ids
    validation: Any  # same layout; zero rows when val_fraction is 0
    report: dict
    cache_path: Path


def prepare_dataset(cfg: DataConfig, tokenizer=None) -> PreparedData:
    """Packed train/validation blocks for `cfg`, from the cache when an identical preparation exists."""
    from datasets import Dataset, load_from_disk

    start = time.perf_counter()
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.tokenizer)
        tokenizer_label = cfg.tokenizer or "gpt2 (offline BPE)"
    else:
        tokenizer_label = tokenizer.name_or_path
    check_tokenizer(tokenizer, cfg.block_size)
    key_inputs = cache_key_inputs(cfg, tokenizer)
    cache_path = Path(cfg.cache_dir).expanduser() / cache_name(cfg, key_inputs)

    if not (cache_path / COMPLETE_MARKER).is_file():
        if cache_path.exists():  # left by something other than a finished preparation: never trust it
            shutil.rmtree(cache_path)
        _build(cfg, tokenizer, tokenizer_label, key_inputs, cache_path, start)
        cache_hit = False
    else:
        cache_hit = True
    try:
        _check_cache_files(cache_path)
        splits = load_from_disk(str(cache_path))
        report = json.loads((cache_path / "report.json").read_text())
    except Exception as err:  # a damaged cache would fail the same way on every run: rebuild it once
        print(f"note: the data cache {cache_path} is damaged ({str(err)[:120]}); preparing it again", flush=True)
        shutil.rmtree(cache_path, ignore_errors=True)
        _build(cfg, tokenizer, tokenizer_label, key_inputs, cache_path, start)
        cache_hit = False
        splits = load_from_disk(str(cache_path))
        report = json.loads((cache_path / "report.json").read_text())
    report.update(cache_hit=cache_hit, cache_path=str(cache_path), seconds=round(time.perf_counter() - start, 3))
    train = splits["train"]
    validation = splits["validation"] if "validation" in splits else Dataset.from_dict({"input_ids": []}, features=train.features)
    return PreparedData(train, validation, report, cache_path)


def _check_cache_files(cache_path: Path) -> None:
    """Every file the COMPLETE marker lists must be there at its recorded size (a truncated Arrow file can load
    and then fail mid-training)."""
    marker = json.loads((cache_path / COMPLETE_MARKER).read_text())
    for name, size in marker["files"].items():
        path = cache_path / name
        if not path.is_file() or path.stat().st_size != size:
            raise ValueError(f"{name} is missing or truncated")


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
            "num_perm": cleaning.NUM_PERM,
            "shingle_words": cleaning.SHINGLE_WORDS,
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
    """Run the pipeline into a temp folder, mark it complete, then rename it to `cache_path`."""
    stage_seconds: dict[str, float] = {}
    lap = _Lap(stage_seconds)
    docs, wikitext = corpus.load_corpus(cfg.dataset, cfg.dataset_config, cfg.text_field, cfg.max_documents)
    lap("load")
    loaded, characters_in = len(docs), int(_text_lengths(docs).sum())
    docs, steps = _clean_and_deduplicate(cfg, docs, wikitext, lap)
    docs = docs.select_columns(["text"])
    num_proc = cfg.num_proc if cfg.num_proc > 1 else None
    tokenized = docs.map(_tokenize_batch, batched=True, batch_size=16, num_proc=num_proc,
                         remove_columns=docs.column_names, desc="Tokenizing",
                         fn_kwargs={"tokenizer": tokenizer, "eos_id": tokenizer.eos_token_id})
    tokenize_seconds = lap("tokenize")
    values, offsets = _flat_token_ids(tokenized)
    train_docs, val_docs = split_documents(np.diff(offsets), cfg.val_fraction, cfg.data_seed)
    train_blocks = pack_blocks(values, offsets, train_docs, cfg.block_size)
    val_blocks = pack_blocks(values, offsets, val_docs, cfg.block_size)
    split = "whole documents"
    if len(train_blocks) == 0 or (cfg.val_fraction > 0 and len(val_blocks) == 0):
        # too few documents to split whole (e.g. one .txt file): split the text itself, and say so
        train_blocks, val_blocks = split_within(values, cfg.block_size, cfg.val_fraction)
        split = "within the text"
        print(f"note: {len(offsets) - 1} document(s) cannot fill both splits with whole documents; the last "
              f"{len(val_blocks)} of {len(train_blocks) + len(val_blocks)} blocks of the text are the validation split",
              flush=True)
    if len(train_blocks) == 0:
        raise UserError(f"{len(values)} tokens make {len(train_blocks) + len(val_blocks)} block(s) of --block_size "
                        f"{cfg.block_size}: not enough to train on after holding out validation; lower --block_size, "
                        "add text or lower --val_fraction")
    lap("pack")
    report = {
        "dataset": cfg.dataset, "dataset_config": cfg.dataset_config, "tokenizer": tokenizer_label,
        "block_size": cfg.block_size, "num_proc": cfg.num_proc, "steps": steps, "documents": len(docs),
        "characters_loaded": characters_in, "split": split,
        "train_documents": len(train_docs) if split == "whole documents" else None,
        "validation_documents": len(val_docs) if split == "whole documents" else None,
        "tokens": int(len(values)), "train_tokens": int(train_blocks.size), "validation_tokens": int(val_blocks.size),
        "dropped_tail_tokens": int(len(values) - train_blocks.size - val_blocks.size),
        "train_blocks": len(train_blocks), "validation_blocks": len(val_blocks), "stage_seconds": stage_seconds,
        "tokenize_seconds": round(tokenize_seconds, 3),
        "tokenize_tokens_per_second": round(len(values) / max(tokenize_seconds, 1e-9), 1),
        "cache_key": key_inputs,
    }
    _write_cache(cache_path, train_blocks, val_blocks, report, loaded, start, lap)


def _clean_and_deduplicate(cfg: DataConfig, docs, wikitext: bool, lap) -> tuple[Any, list[dict]]:
    """Markup/NFKC cleaning and the length filter, then exact and near-duplicate removal; each step counted."""
    num_proc = cfg.num_proc if cfg.num_proc > 1 else None
    loaded = len(docs)
    steps = [{"step": "loaded", "in": loaded, "out": loaded}]
    near_dedup = cfg.near_dup_threshold > 0
    docs = docs.map(cleaning.clean_batch, batched=True, batch_size=16, num_proc=num_proc, desc="Cleaning",
                    fn_kwargs={"wikitext": wikitext, "with_minhash": near_dedup})
    docs = _filter_short(docs, cfg.min_doc_chars)
    lap("clean")
    steps.append(_step(f"shorter than {cfg.min_doc_chars} chars", loaded, len(docs)))
    if len(docs) == 0:
        raise UserError(
            f"corpus {cfg.dataset} is empty after cleaning ({loaded} documents loaded, none with "
            f">= {cfg.min_doc_chars} characters); pass more text or lower --min_doc_chars"
        )
    before = len(docs)
    docs = _drop(docs, cleaning.exact_duplicate_indices(docs["exact_hash"]))
    steps.append(_step("exact duplicates", before, len(docs)))
    before = len(docs)
    if near_dedup:
        signatures = _fixed_rows(docs, "minhash", cleaning.NUM_PERM)
        text_of = lambda i: docs[i]["text"]  # noqa: E731 -- only LSH candidates are read back
        docs = _drop(docs, cleaning.near_duplicate_indices(signatures, cfg.near_dup_threshold, text_of))
        steps.append(_step(f"near duplicates (Jaccard >= {cfg.near_dup_threshold})", before, len(docs)))
    else:
        steps.append(_step("near duplicates (disabled)", before, before))
    lap("dedup")
    return docs, steps


def _write_cache(cache_path: Path, train_blocks, val_blocks, report: dict, loaded: int, start: float, lap) -> None:
    """Save both splits under a temp name, seal them with COMPLETE (file sizes), rename into place."""
    from datasets import DatasetDict

    cache_path.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_temp_dirs(cache_path)
    tmp = cache_path.with_name(f".{cache_path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        splits = {"train": blocks_dataset(train_blocks)}
        if len(val_blocks):  # datasets cannot load a saved zero-row split; an empty one is rebuilt on load
            splits["validation"] = blocks_dataset(val_blocks)
        DatasetDict(splits).save_to_disk(str(tmp))
        lap("save")
        report["prepare_seconds"] = round(time.perf_counter() - start, 3)
        report["documents_per_second"] = round(loaded / max(report["prepare_seconds"], 1e-9), 2)
        report["tokens_per_second"] = round(report["tokens"] / max(report["prepare_seconds"], 1e-9), 1)
        atomic_write_json(tmp / "report.json", report)
        sizes = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
        # written last: only finished folders carry it
        atomic_write_text(tmp / COMPLETE_MARKER, json.dumps({"files": sizes}) + "\n")
        try:
            os.replace(tmp, cache_path)
        except OSError:
            if not (cache_path / COMPLETE_MARKER).is_file():  # not a concurrent finished build of the same key
                raise
    except OSError as err:
        full = err.errno == 28 or "No space left" in str(err)
        raise UserError(f"could not write the data cache {cache_path}: "
                        f"{'the disk is full' if full else str(err).splitlines()[0][:160]}; free space or pass "
                        "another --cache_dir") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _Lap:
    """Seconds per pipeline stage, for the report."""

    def __init__(self, into: dict):
        self.into, self.last = into, time.perf_counter()

    def __call__(self, stage: str) -> float:
        now = time.perf_counter()
        self.into[stage] = round(now - self.last, 3)
        self.last = now
        return self.into[stage]


def _step(name: str, before: int, after: int) -> dict:
    return {"step": name, "in": before, "out": after}


def _text_lengths(docs) -> np.ndarray:
    """Characters per document, computed in Arrow without building Python strings."""
    import pyarrow.compute as pc

    if len(docs) == 0:
        return np.zeros(0, dtype=np.int64)
    table = docs.with_format("arrow")[:]  # respects a previous select()
    return pc.utf8_length(table.column("text")).to_numpy(zero_copy_only=False).astype(np.int64)


def _fixed_rows(ds, column: str, width: int) -> np.ndarray:
    """A list column whose rows all have `width` numbers, as an (n, width) array."""
    import pyarrow as pa

    chunked = ds.with_format("arrow")[:].column(column)
    array = pa.concat_arrays(chunked.chunks) if chunked.num_chunks else pa.array([], pa.list_(pa.uint32()))
    return np.asarray(array.flatten().to_numpy(zero_copy_only=False)).reshape(len(ds), width)


def _filter_short(docs, min_chars: int):
    keep = np.flatnonzero(_text_lengths(docs) >= max(min_chars, 1))
    return docs.select(keep) if len(keep) < len(docs) else docs


def _drop(docs, indices: list[int]):
    if not indices:
        return docs
    drop = set(indices)
    return docs.select([i for i in range(len(docs)) if i not in drop])


def _tokenize_batch(batch: dict, tokenizer, eos_id: int) -> dict:
    ids = tokenizer(batch["text"], add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    return {"input_ids": [doc + [eos_id] for doc in ids]}


def _flat_token_ids(tokenized) -> tuple[np.ndarray, np.ndarray]:
    """All documents' ids as one flat array plus offsets (document i is values[offsets[i]:offsets[i+1]])."""
    column = tokenized.data.column("input_ids").combine_chunks()
    offsets = np.asarray(column.offsets, dtype=np.int64)
    values = np.asarray(column.values, dtype=np.int64)
    return values[offsets[0] : offsets[-1]], offsets - offsets[0]


def _remove_abandoned_temp_dirs(cache_path: Path) -> None:
    """Delete temp folders left by killed preparations (their process is gone)."""
    for tmp in cache_path.parent.glob(".*.tmp-*"):
        pid = tmp.name.rsplit(".tmp-", 1)[1].split("-")[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def format_prepare_summary(report: dict) -> str:
    """The human-readable summary that `train_pretrain.py --prepare_only` prints."""
    lines = [f"dataset {report['dataset']}" + (f" ({report['dataset_config']})" if report.get("dataset_config") else "")
             + f", tokenizer {report['tokenizer']}, block_size {report['block_size']}"]
    lines.append(f"{'cleaning step':<42}{'docs in':>10}{'docs out':>10}{'removed':>10}")
    for step in report["steps"]:
        lines.append(f"{step['step']:<42}{step['in']:>10}{step['out']:>10}{step['in'] - step['out']:>10}")
    if report.get("split", "whole documents") == "whole documents":
        lines.append(f"documents kept: {report['documents']} (train {report['train_documents']}, "
                     f"validation {report['validation_documents']})")
    else:
        lines.append(f"documents kept: {report['documents']}, split within the text (too few to split whole)")
    lines.append(f"tokens: {report['tokens']:,} (incl. one eos per document); dropped tail remainder: "
                 f"{report['dropped_tail_tokens']:,}")
    lines.append(f"blocks of {report['block_size']}: train {report['train_blocks']:,}, "
                 f"validation {report['validation_blocks']:,}")
    lines.append(f"tokenisation: {report['tokenize_tokens_per_second']:,.0f} tokens/s "
                 f"({report['tokenize_seconds']:.2f} s, num_proc {report['num_proc']}); whole preparation "
                 f"{report['prepare_seconds']:.2f} s, {report['documents_per_second']:,.1f} documents/s, "
                 f"{report['tokens_per_second']:,.0f} tokens/s")
    if report.get("stage_seconds"):
        lines.append("seconds per stage: " + ", ".join(f"{k} {v:.2f}" for k, v in report["stage_seconds"].items()))
    origin = "reused from cache" if report.get("cache_hit") else "written to cache"
    lines.append(f"{origin}: {report.get('cache_path', '?')}")
    return "\n".join(lines)
