"""Packing: a seeded document-level train/validation split, then documents cut into blocks of exactly block_size.

Every document already ends in eos; blocks are filled across document boundaries (no padding, as in GPT-2 and
nanoGPT) and the tail that does not fill a block is dropped.
"""
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


def pack_blocks(values: np.ndarray, offsets: np.ndarray, doc_indices: np.ndarray, block_size: int) -> np.ndarray:
    """Concatenate the documents (each already ending in eos) and cut full blocks; the tail is dropped."""
    if len(doc_indices) == 0:
        return np.zeros((0, block_size), dtype=np.int64)
    stream = np.concatenate([values[offsets[i] : offsets[i + 1]] for i in doc_indices])
    n_blocks = len(stream) // block_size
    return stream[: n_blocks * block_size].reshape(n_blocks, block_size)


def split_within(values: np.ndarray, block_size: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """For a corpus of too few documents to split whole: all blocks in text order, the last val_fraction of them
    (at least one) for validation, so the two splits share no block and meet at one boundary."""
    blocks = pack_blocks(values, np.array([0, len(values)]), np.array([0]), block_size)
    n_val = max(1, round(val_fraction * len(blocks))) if val_fraction > 0 else 0
    return blocks[: len(blocks) - n_val], blocks[len(blocks) - n_val:]


def blocks_dataset(blocks: np.ndarray):
    import pyarrow as pa
    from datasets import Dataset

    flat = pa.array(blocks.reshape(-1), type=pa.int64())
    column = pa.FixedSizeListArray.from_arrays(flat, blocks.shape[1])
    return Dataset(pa.table({"input_ids": column}))
