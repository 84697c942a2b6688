"""Near-duplicate removal in stages on disk (datatrove's MinHash design), so its memory does not grow with the corpus.

1. signatures: while staging (prepare._stage), each staged document's BANDS LSH keys (llmlab.data.minhash) are
   appended to stage/bands.bin, 8 bytes a key, in staged order, so a row number is a document id;
2. buckets: per band, its keys sorted; documents with equal keys are candidate pairs: each with the next one in its
   run (a chain, as datatrove emits) and each with the run's first, so a group of copies joins through its base even
   where the copies are less alike to each other than to it; at most 2 pairs a document a band, written to
   near_dup/pairs_<band>.npy;
3. clusters: each candidate pair confirmed by the exact Jaccard of the two documents' shingle sets, then the
   confirmed pairs' connected components (scipy); every document but the first of its component is a near
   duplicate: near_dup/removed.npy;
4. filter: packing (prepare._pack) leaves the removed documents out of both splits.
Stages 2 and 3 write each file atomically and skip what exists, so a killed run resumes where it stopped.
Memory: stage 2 holds one band's keys and their sort order (24 bytes a document), stage 3 the candidate pairs.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

from llmlab.core.io import progress_bar
from llmlab.data import minhash

BANDS_FILE = "bands.bin"
FOLDER = "near_dup"


def candidate_pairs(keys: np.ndarray) -> np.ndarray:
    """(pairs, 2) document ids, lower first: in each run of equal keys, every member with the one before it and with
    the run's first (its earliest document)."""
    order = np.argsort(keys, kind="stable")  # stable: ids ascend within a run
    same = keys[order[1:]] == keys[order[:-1]]
    members = np.flatnonzero(same) + 1  # sorted positions that are not the first of their run
    starts = np.flatnonzero(np.concatenate([[True], ~same]))
    first = starts[np.searchsorted(starts, members, side="right") - 1]
    star = members - 1 != first  # the chain already pairs the run's second with its first
    chain = np.stack([order[members - 1], order[members]], axis=1)
    to_first = np.stack([order[first[star]], order[members[star]]], axis=1)
    return np.concatenate([chain, to_first]).astype(np.int64)


def removed_documents(pairs: np.ndarray, threshold: float, text_of: Callable[[int], str], progress=None) -> np.ndarray:
    """Sorted ids of the documents that are not the first of their cluster, where a cluster joins every candidate
    pair whose exact shingle Jaccard is >= threshold."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    pairs = np.unique(pairs, axis=0) if len(pairs) else pairs.reshape(0, 2)
    if progress is not None:
        progress.total = len(pairs)
    shingles = lru_cache(maxsize=4096)(lambda i: minhash.shingle_set(text_of(i)))
    confirmed = np.zeros(len(pairs), dtype=bool)
    for k, (i, j) in enumerate(pairs):
        confirmed[k] = minhash.jaccard(shingles(int(i)), shingles(int(j))) >= threshold
        if progress is not None:
            progress.update(1)
    edges = pairs[confirmed]
    if not len(edges):
        return np.zeros(0, dtype=np.int64)
    nodes, local = np.unique(edges, return_inverse=True)  # only the documents that have a confirmed pair
    local = local.reshape(-1, 2)
    graph = coo_matrix((np.ones(len(local)), (local[:, 0], local[:, 1])), shape=(len(nodes), len(nodes)))
    _, labels = connected_components(graph, directed=False)
    _, first = np.unique(labels, return_index=True)  # nodes ascend, so a component's first index is its first id
    keep = np.zeros(len(nodes), dtype=bool)
    keep[first] = True
    return nodes[~keep]


def find(stage: Path, documents: int, threshold: float, text_of: Callable[[int], str], save) -> np.ndarray:
    """Stages 2 and 3 over stage/bands.bin (`documents` rows), resumable; `save(path, array)` writes atomically."""
    folder = stage / FOLDER
    folder.mkdir(exist_ok=True)
    result = folder / "removed.npy"
    if result.is_file():
        return np.load(result)
    bands = np.memmap(stage / BANDS_FILE, dtype=np.uint64, mode="r", shape=(documents, minhash.BANDS))
    pairs = []
    with progress_bar(desc="Near-dup buckets", unit="band", total=minhash.BANDS) as bar:
        for band in range(minhash.BANDS):
            path = folder / f"pairs_{band:02d}.npy"
            if not path.is_file():
                save(path, candidate_pairs(np.array(bands[:, band])))
            pairs.append(np.load(path))
            bar.update(1)
    del bands
    pairs = np.concatenate(pairs)
    with progress_bar(desc="Near-dup confirm", unit="pair") as bar:
        removed = removed_documents(pairs, threshold, text_of, bar)
    save(result, removed)
    return removed


def disk_bytes(stage: Path) -> int:
    """What the near-dup stages hold on disk now (the band keys and the candidate pairs)."""
    paths = [stage / BANDS_FILE, *(stage / FOLDER).glob("*.npy")]
    return sum(os.path.getsize(p) for p in paths if p.is_file())
