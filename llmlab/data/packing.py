"""The seeded document-level train/validation split (llmlab.data.prepare packs each split's documents, in this
order, into blocks of exactly block_size: every document already ends in eos, blocks are filled across document
boundaries with no padding, as in GPT-2 and nanoGPT, and the tail that does not fill a block is dropped)."""

from __future__ import annotations

import numpy as np


def split_documents(doc_lengths: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded document-level split: shuffled documents go to validation until it holds val_fraction of tokens.

    Whole documents, so no text is shared between the splits. Returns (train, validation) document
    indices, each in shuffled order.
    """
    order = np.random.default_rng(seed).permutation(len(doc_lengths))
    if val_fraction <= 0:
        return order, order[:0]
    target = val_fraction * float(np.sum(doc_lengths))
    n_val = int(np.searchsorted(np.cumsum(doc_lengths[order]), target)) + 1
    n_val = min(n_val, len(order) - 1) if len(order) > 1 else len(order)
    return order[n_val:], order[:n_val]
