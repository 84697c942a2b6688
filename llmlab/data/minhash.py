"""MinHash signatures and LSH band keys for near-duplicate detection, in numpy batches.

Why by hand: datasketch, rensa and datatrove all take a document's shingles as Python strings, and building those
strings costs more than tokenising the text (bench/minhash_speed.py). Here a batch of documents is one byte array:
words are found, hashed and joined into word 5-gram shingles with array operations, and one-permutation hashing
makes the signature in one pass over the shingles instead of NUM_PERM.

Definitions (they key the prepared-data cache, see prepare.cache_key_inputs):
- a document's words are its maximal runs of word bytes in its UTF-8 with ASCII lower-cased: ASCII letters,
  digits, "_" and every byte of a non-ASCII character (so "café" is one word, as \\w+ would have it);
- its shingles are the set of its word 5-grams (the whole document when it has fewer than 5 words);
- similarity is the exact Jaccard of two documents' shingle sets (64-bit shingle hashes: collisions ~2^-64);
- a signature is NUM_PERM one-permutation MinHash values (see signatures); BANDS keys of ROWS values each index
  it for LSH.
"""

from __future__ import annotations

import numpy as np

SHINGLE_WORDS = 5
NUM_PERM = 128
# 16 bands of 8 rows: a pair with Jaccard J collides in some band with 1 - (1 - J^8)^16: 99.4 % at 0.85,
# 99.99 % at 0.9, 6 % at 0.5 (the candidates are then confirmed exactly, so a collision costs time, not precision)
BANDS, ROWS = 16, 8

_P = np.uint64(0x100000001B3)  # FNV-64's prime: the word hash's polynomial base (odd, so invertible mod 2^64)
_P_INVERSE = np.uint64(pow(int(_P), -1, 2**64))
_WORD_BYTE = np.zeros(256, dtype=bool)
for _c in b"abcdefghijklmnopqrstuvwxyz0123456789_":
    _WORD_BYTE[_c] = True
_WORD_BYTE[0x80:] = True
_SHINGLE_MIX = np.array(
    [0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93, 0xFF51AFD7ED558CCD],
    dtype=np.uint64,
)[:SHINGLE_WORDS]
_CHUNK_CHARS = 1 << 20
_EMPTY = np.uint64(1 << 32)  # above any 32-bit value: a bin no shingle fell in
_ROTATION = np.uint64(0x9E3779B1)  # densification's offset per bin borrowed across (odd, so distances differ)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every output bit depends on every input bit."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def shingle_hashes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """64-bit hashes of every document's word 5-grams, concatenated, and the index where each document's start
    (len(texts) + 1 entries). Repeated shingles are repeated here (a minimum does not care)."""
    data = np.frombuffer(" ".join(texts).encode("utf-8").lower() + b" ", dtype=np.uint8)  # ASCII lower-cased
    is_word = _WORD_BYTE[data]
    edges = np.diff(is_word.astype(np.int8), prepend=np.int8(0))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    with np.errstate(over="ignore"):
        # polynomial hash of each word: prefix sums of byte * P^i, a word's slice divided by P^start
        prefix = np.concatenate([[np.uint64(0)], np.cumsum(data.astype(np.uint64) * _powers(_P, len(data)))])
        inv_powers = _powers(_P_INVERSE, len(data))
        words = _mix((prefix[ends] - prefix[starts]) * inv_powers[starts] + (ends - starts).astype(np.uint64))
    # which document each word belongs to: texts were joined by one space, so offsets are known
    byte_starts = np.cumsum([0] + [len(t.encode("utf-8")) + 1 for t in texts])
    word_doc = np.searchsorted(byte_starts, starts, side="right") - 1
    word_first = np.searchsorted(word_doc, np.arange(len(texts) + 1))
    return _join_shingles(words, word_doc, word_first, len(texts))


_POWERS: dict = {}


def _powers(base: np.uint64, n: int) -> np.ndarray:
    """base^0 .. base^(n-1) mod 2^64, computed once per process for the longest batch so far."""
    have = _POWERS.get(int(base))
    if have is None or len(have) < n:
        size = max(n, 1 << 20)
        with np.errstate(over="ignore"):
            have = np.concatenate([[np.uint64(1)], np.cumprod(np.full(size - 1, base, dtype=np.uint64))])
        _POWERS[int(base)] = have
    return have[:n]


def _join_shingles(words: np.ndarray, word_doc: np.ndarray, word_first: np.ndarray, n_docs: int):
    """Word hashes -> shingle hashes (windows of SHINGLE_WORDS words within a document)."""
    k = SHINGLE_WORDS
    counts = np.diff(word_first)
    with np.errstate(over="ignore"):
        if len(words) >= k:
            windows = words[: len(words) - k + 1] * _SHINGLE_MIX[0]
            for j in range(1, k):
                windows = windows + words[j : len(words) - k + 1 + j] * _SHINGLE_MIX[j]
            windows = _mix(windows)
            inside = word_doc[: len(words) - k + 1] == word_doc[k - 1 :]  # the window ends in the same document
            full = windows[inside]
            full_doc = word_doc[: len(words) - k + 1][inside]
        else:
            full, full_doc = np.zeros(0, np.uint64), np.zeros(0, np.int64)
        short_docs = np.flatnonzero(counts < k)  # fewer than 5 words: the whole document is its one shingle
        short = np.zeros(len(short_docs), dtype=np.uint64)
        for out, d in enumerate(short_docs):
            for j, w in enumerate(words[word_first[d] : word_first[d + 1]]):
                short[out] = short[out] + w * _SHINGLE_MIX[j]
        short = _mix(short)
    hashes = np.concatenate([full, short])
    docs = np.concatenate([full_doc, short_docs])
    order = np.argsort(docs, kind="stable")
    hashes, docs = hashes[order], docs[order]
    return hashes, np.searchsorted(docs, np.arange(n_docs + 1))


def signatures(texts: list[str]) -> np.ndarray:
    """(documents, NUM_PERM) uint32 MinHash signatures by one-permutation hashing (Li, Owen and Zhang 2012): a
    shingle's hash picks one of NUM_PERM bins by its top bits, each bin keeps the least low 32 bits, so the cost is
    one pass over the shingles, not NUM_PERM. Empty bins (documents of fewer than a few hundred shingles) borrow
    the next full bin's value (rotation densification, Shrivastava and Li 2014), so equal bins still mean Jaccard."""
    groups, size, start = [], 0, 0
    for i, text in enumerate(texts):  # about 1M characters at a time: the arrays cost ~50 bytes a character
        size += len(text)
        if size >= _CHUNK_CHARS or i == len(texts) - 1:
            groups.append(_signatures(texts[start : i + 1]))
            size, start = 0, i + 1
    return np.concatenate(groups) if groups else np.empty((0, NUM_PERM), dtype=np.uint32)


def _signatures(texts: list[str]) -> np.ndarray:
    hashes, first = shingle_hashes(texts)
    n = len(texts)
    slot = np.repeat(np.arange(n, dtype=np.int64) * NUM_PERM, np.diff(first)) + (hashes >> np.uint64(57)).astype(
        np.int64
    )
    signature = np.full(n * NUM_PERM, _EMPTY, dtype=np.uint64)
    np.minimum.at(signature, slot, hashes & np.uint64(0xFFFFFFFF))
    return _densify(signature.reshape(n, NUM_PERM)).astype(np.uint32)


def _densify(signature: np.ndarray) -> np.ndarray:
    empty = signature == _EMPTY
    if not empty.any():
        return signature
    k = NUM_PERM
    full_at = np.where(empty, 3 * k, np.arange(k))  # every document has at least one full bin
    ahead = np.concatenate([full_at, full_at + k], axis=1)
    nearest = np.minimum.accumulate(ahead[:, ::-1], axis=1)[:, ::-1][:, :k]  # next full bin at or after j
    rows = np.arange(len(signature))[:, None]
    with np.errstate(over="ignore"):
        borrowed = signature[rows, nearest % k] + _ROTATION * (nearest - np.arange(k)).astype(np.uint64)
    return np.where(empty, borrowed & np.uint64(0xFFFFFFFF), signature)


def band_keys(signature: np.ndarray) -> np.ndarray:
    """(documents, BANDS) uint64: one hash of each band's ROWS values; equal keys make a candidate pair."""
    rows = signature.reshape(len(signature), BANDS, ROWS).astype(np.uint64)
    key = np.zeros(rows.shape[:2], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for r in range(ROWS):
            key = _mix(key * np.uint64(0x100000001B3) + rows[:, :, r])
    return key


def shingle_set(text: str) -> np.ndarray:
    """A document's sorted unique shingle hashes: its shingle set, for the exact Jaccard."""
    hashes, _ = shingle_hashes([text])
    return np.unique(hashes)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard of two sorted unique shingle-hash arrays."""
    shared = len(np.intersect1d(a, b, assume_unique=True))
    return shared / (len(a) + len(b) - shared) if len(a) or len(b) else 1.0
