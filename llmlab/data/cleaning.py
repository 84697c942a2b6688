"""Document cleaning: markup stripping, NFKC, length filter, exact and near-duplicate removal.

Per-document work (normalising text, hashing, MinHash signatures) runs as one batched `datasets.map`
call so `num_proc` parallelises it; the duplicate decisions are one sequential pass in corpus order,
so the first copy of a document is the one kept, whatever `num_proc` is.
"""

from __future__ import annotations

import hashlib
import html
import re
import unicodedata
import zlib

import numpy as np

# Bump when the cleaning output changes, so old caches are not reused.
CLEANING_VERSION = 3  # 3: near-duplicates confirmed by exact Jaccard, recall-first LSH
NUM_PERM = 128  # MinHash permutations: standard error of a Jaccard estimate <= 0.5/sqrt(128) = 0.044
SHINGLE_WORDS = 5  # near-duplicate shingles are word 5-grams (lower-cased)
MINHASH_SEED = 1
MINHASH_SCHEME = "affine32"  # shingles hashed with crc32 (C speed, stable across processes; 3x faster
# than datasketch's default sha1 here), then permuted by MinHash's random affine maps

_SCRIPT_STYLE = re.compile(r"<(script|style)\b[^>]*>.*?</\1\s*>", re.IGNORECASE | re.DOTALL)
_HTML_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_HTML_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9:-]*(?:\s[^<>]*)?/?>")
_WIKI_HEADING = re.compile(r"^[ \t]*(={1,6})[ \t]*(.*?)[ \t]*\1[ \t]*$", re.MULTILINE)
_WIKI_EMPHASIS = re.compile(r"'{2,}")
_WIKI_LINK = re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]]*)\]\]")
_WIKI_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
# Image leftovers gensim's filter keeps: gallery lines "File:x.jpg|caption" and "caption|alt=description".
_WIKI_GALLERY_FILE = re.compile(r"^(?:File|Image):[^|\n]*\|", re.MULTILINE)
_WIKI_IMAGE_ALT = re.compile(r"\|alt=[^\n]*")
_SPACES = re.compile(r"[ \t\u00a0]+")
_SPACE_AROUND_NEWLINE = re.compile(r" *\n *")
_MANY_NEWLINES = re.compile(r"\n{3,}")
_WORD = re.compile(r"\w+")


# Each markup pass runs only when the text (as it is at that point) holds what the pass needs: plain prose, most of
# a web corpus, then costs the whitespace passes alone, with the same output (bench/data_scale.py).
_MARKUP_PASSES = (
    ("<", lambda t: _HTML_TAG.sub(" ", _HTML_COMMENT.sub(" ", _SCRIPT_STYLE.sub(" ", t)))),
    ("&", html.unescape),  # after tag removal, so an escaped "&lt;b&gt;" stays literal text
    ("{{", lambda t: _WIKI_TEMPLATE.sub(" ", t)),
    ("[[", lambda t: _WIKI_LINK.sub(r"\1", t)),
    (":", lambda t: _WIKI_GALLERY_FILE.sub("", t)),
    ("|alt=", lambda t: _WIKI_IMAGE_ALT.sub("", t)),
    ("=", lambda t: _WIKI_HEADING.sub(r"\2", t)),
    ("''", lambda t: _WIKI_EMPHASIS.sub("", t)),
)


def clean_text(text: str) -> str:
    """NFKC-normalised text without HTML tags/entities or wiki markup, whitespace tidied."""
    text = unicodedata.normalize("NFKC", text)  # full-width ＡＢＣ１２３ -> ABC123, ligatures split
    for needed, markup_pass in _MARKUP_PASSES:
        if needed in text:
            text = markup_pass(text)
    if "  " in text or "\t" in text or "\u00a0" in text:  # a lone space is already what _SPACES makes
        text = _SPACES.sub(" ", text)
    if " \n" in text or "\n " in text:
        text = _SPACE_AROUND_NEWLINE.sub("\n", text)
    if "\n\n\n" in text:
        text = _MANY_NEWLINES.sub("\n\n", text)
    return text.strip()


def exact_hash(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def clean_batch(batch: dict, wikitext: bool = False, with_minhash: bool = True) -> dict:
    """Cleaned text, its exact-duplicate hash and (optionally) its MinHash signature, for a batch of documents.

    One pass per document, so `datasets.map(num_proc=N)` pays its worker start-up once for all of it.
    """
    texts = batch["text"]
    if wikitext:
        from gensim.corpora.wikicorpus import filter_wiki  # removes templates, links, tables, refs

        texts = [filter_wiki(t) for t in texts]
    texts = [clean_text(t) for t in texts]
    out = {"text": texts, "exact_hash": [exact_hash(t) for t in texts]}
    if with_minhash:
        out["minhash"] = minhash_signatures(texts)
    return out


def shingles(text: str) -> set[bytes]:
    words = _WORD.findall(text.lower())
    if len(words) <= SHINGLE_WORDS:
        return {" ".join(words).encode()}
    return {" ".join(words[i : i + SHINGLE_WORDS]).encode() for i in range(len(words) - SHINGLE_WORDS + 1)}


def minhash_signatures(texts: list[str]) -> list[np.ndarray]:
    from datasketch import MinHash

    minhashes = MinHash.bulk(
        [list(shingles(t)) for t in texts],
        num_perm=NUM_PERM,
        seed=MINHASH_SEED,
        scheme=MINHASH_SCHEME,
        hashfunc=zlib.crc32,
    )
    return [m.hashvalues for m in minhashes]


def exact_duplicate_indices(hashes: list[str]) -> list[int]:
    """Indices of documents whose cleaned text already occurred earlier."""
    seen: set[str] = set()
    dups = []
    for i, h in enumerate(hashes):
        if h in seen:
            dups.append(i)
        seen.add(h)
    return dups


# LSH banding chosen for recall: datasketch's default weights (0.5, 0.5) give 8 bands of 16 rows, which propose
# only 81 % of pairs with Jaccard 0.9 at threshold 0.85. Weights (0.005, 0.995) give 16 bands of 8 rows: 99.4 % of
# pairs at the threshold and 99.99 % at 0.9 become candidates; the extra candidates are settled exactly below.
LSH_WEIGHTS = (0.005, 0.995)


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def near_duplicate_indices(signatures, threshold: float, text_of=None) -> list[int]:
    """Indices of documents whose Jaccard similarity to an earlier kept document is >= threshold.

    LSH proposes candidates; each is confirmed with the exact Jaccard of the two documents' shingle sets
    (`text_of(i)` gives document i's text), or, without texts, with the MinHash estimate.
    """
    from datasketch import LeanMinHash, MinHashLSH

    lsh = MinHashLSH(threshold=threshold, num_perm=NUM_PERM, weights=LSH_WEIGHTS)
    kept: dict[int, LeanMinHash] = {}
    shingle_cache: dict[int, set] = {}

    def shingles_of(i: int) -> set:
        if i not in shingle_cache:
            shingle_cache[i] = shingles(text_of(i))
        return shingle_cache[i]

    def similar(i: int, m, j: int) -> bool:
        if text_of is None:
            return kept[j].jaccard(m) >= threshold
        return jaccard(shingles_of(i), shingles_of(j)) >= threshold

    dups = []
    for i, hashvalues in enumerate(signatures):
        m = LeanMinHash(seed=MINHASH_SEED, hashvalues=np.asarray(hashvalues), scheme=MINHASH_SCHEME)
        if any(similar(i, m, j) for j in lsh.query(m)):
            dups.append(i)
            shingle_cache.pop(i, None)
            continue
        lsh.insert(i, m)
        kept[i] = m
    return dups
