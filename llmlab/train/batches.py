"""Batches of token blocks, for the trainers and the lab's trials: the trainers' loaders (`make_dataloaders`,
shuffled per epoch from the seed, sharded and resumed by accelerate; `batch_stream` from any data position) and a
trial's feed (`Batches`: seeded, epoch-wise shuffled rows with their labels: whole rows, one document per row with
padding masked, or a fixed share of the targets left out). The trial keeps its numpy order: the lab's registered
scans' recorded losses depend on it."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

EOS = 50256  # GPT-2's <|endoftext|>: every document of the lab's data ends with it


def document_rows(tokens: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """loss_mask padding: one document per row (long ones over several rows), right-padded with eos; returns the
    rows and which positions are real tokens (padding is never a target)."""
    stream = np.asarray(tokens).reshape(-1)
    ends = np.flatnonzero(stream == EOS) + 1
    rows, real = [], []
    for start, stop in zip(np.concatenate([[0], ends[:-1]]), ends):
        for piece in range(start, stop, block):
            chunk = stream[piece : min(piece + block, stop)]
            rows.append(np.pad(chunk, (0, block - len(chunk)), constant_values=EOS))
            real.append(np.arange(block) < len(chunk))
    return np.stack(rows), np.stack(real)


def target_mask(rows: int, block: int, ratio: float) -> np.ndarray:
    """token_mask_ratio: which label positions stay in the training loss. A fraction `ratio` of the targets is left
    out in a fixed interleaved pattern shifted by one position per row (0.5: odd positions in one row, even in the
    next). Label position 0 is never a target (the shift drops it)."""
    if ratio <= 0:
        return np.ones((rows, block), dtype=bool)
    index = np.arange(block)[None, :] + np.arange(rows)[:, None]
    return (index * ratio) % 1.0 >= ratio


class Batches:
    """Seeded, epoch-wise shuffled training rows, with each row's labels (-100 where a position is no target)."""

    def __init__(
        self, tokens: np.ndarray, seed: int, block: int, loss_mask: str = "none", token_mask_ratio: float = 0.0
    ):
        real = None
        if loss_mask == "padding":
            tokens, real = document_rows(tokens, block)
        self.tokens, self.real, self.ratio = tokens, real, token_mask_ratio
        self.rng, self.order, self.cursor = np.random.default_rng(seed), np.array([], int), 0

    def take(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        while len(rows) < count:
            if self.cursor >= len(self.order):
                self.order, self.cursor = self.rng.permutation(len(self.tokens)), 0
            take = min(count - len(rows), len(self.order) - self.cursor)
            rows.extend(self.order[self.cursor : self.cursor + take])
            self.cursor += take
        picked = np.sort(rows)
        ids = np.asarray(self.tokens[picked], dtype=np.int64)
        keep = target_mask(len(ids), ids.shape[1], self.ratio)
        if self.real is not None:
            keep &= self.real[picked]
        return torch.from_numpy(ids), torch.from_numpy(np.where(keep, ids, -100))


def make_dataloaders(cfg, data):
    """Shuffled training batches (a fixed permutation per epoch from the seed) and in-order validation.

    Loaders get their own generators so that creating an iterator never draws from the global RNG: a
    resumed run then sees the same dropout masks as an uninterrupted one.
    """

    train = data.train.with_format("torch")
    val = data.validation.with_format("torch")
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed)
    train_dl = DataLoader(
        train,
        batch_size=cfg.batch_size,
        sampler=sampler,
        drop_last=True,
        generator=torch.Generator().manual_seed(cfg.seed),
        pin_memory=cfg.pin_memory and torch.cuda.is_available(),  # accelerate then copies it without blocking
    )
    val_dl = DataLoader(
        val,
        batch_size=cfg.batch_size,
        shuffle=False,
        drop_last=len(val) >= cfg.batch_size,
        generator=torch.Generator().manual_seed(cfg.seed),
    )
    return train_dl, val_dl


def batch_stream(accelerator, train_dl, position: int):
    """Endless micro-batches starting at data position `position` (micro-batches consumed so far)."""
    epoch, offset = divmod(position, len(train_dl))
    while True:
        train_dl.set_epoch(epoch)
        loader = accelerator.skip_first_batches(train_dl, offset) if offset else train_dl
        yield from loader
        epoch, offset = epoch + 1, 0
