"""Per-trial summary metrics computed from a trial's recorded curves (pure functions, easy to test)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np


def finite_values(values) -> np.ndarray:
    array = np.asarray(values, dtype=float)
    return array[np.isfinite(array)]


def stability_index(losses: list[float], window: int = 100) -> Optional[float]:
    """std / mean of the last `window` training losses: lower is steadier."""
    tail = finite_values(losses[-window:])
    if len(tail) < 2 or tail.mean() == 0:
        return None
    return float(tail.std() / tail.mean())


def initial_loss_slope(losses: list[float], window: int = 50) -> Optional[float]:
    """Least-squares slope (loss per step) over the first `window` steps; more negative = faster start."""
    head = np.asarray(losses[:window], dtype=float)
    steps = np.arange(len(head))
    keep = np.isfinite(head)
    if keep.sum() < 2:
        return None
    return float(np.polyfit(steps[keep], head[keep], 1)[0])


def early_loss_std(losses: list[float], window: int = 100) -> Optional[float]:
    head = finite_values(losses[:window])
    return float(head.std()) if len(head) >= 2 else None


def mean_std(values: list[float]) -> tuple[Optional[float], Optional[float]]:
    array = finite_values(values)
    if not len(array):
        return None, None
    return float(array.mean()), float(array.std())


def smooth(losses: list[float], window: int = 10) -> np.ndarray:
    """Trailing moving average (the first points average what exists so far)."""
    array = np.asarray(losses, dtype=float)
    if not len(array):
        return array
    cumulative = np.cumsum(np.insert(array, 0, 0.0))
    starts = np.maximum(np.arange(1, len(array) + 1) - window, 0)
    return (cumulative[1:] - cumulative[starts]) / (np.arange(1, len(array) + 1) - starts)


def steps_to_target(losses: list[float], target: float, window: int = 10) -> Optional[int]:
    """First step (1-based count) at which the smoothed training loss reaches `target`; None if never."""
    reached = np.nonzero(smooth(losses, window) <= target)[0]
    return int(reached[0]) + 1 if len(reached) else None


def default_target(control_losses: list[float], share: float = 0.9, window: int = 10) -> Optional[float]:
    """The loss after `share` of the control's (smoothed) drop from its start to its end."""
    curve = smooth(control_losses, window)
    if len(curve) < 2:
        return None
    start, end = float(curve[0]), float(curve[-1])
    return start - share * (start - end) if end < start else None


def layer_group(name: str) -> str:
    """`blocks.2.attn.qkv.weight` -> `blocks.2`; `transformer.h.3.mlp...` -> `transformer.h.3`."""
    parts = name.split(".")
    for index, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return parts[0]


def reference_lines(data_dir: Path, eval_rows: int, vocab_size: int = 50257) -> Optional[dict]:
    """What "learned something" means on the rows trials are evaluated on: the uniform guess, and an add-one
    unigram model of the training split. A few evaluation rows can sit far from the split's average (at the cpu
    budget the first 32 rows score 7.06 under the unigram model, the whole split 7.79), so every report prints
    the lines for its own rows instead of quoting a corpus-wide number."""
    try:
        train = np.load(Path(data_dir) / "train.npy", mmap_mode="r").ravel()
        rows = np.load(Path(data_dir) / "validation.npy", mmap_mode="r")[:eval_rows].ravel()
    except (OSError, ValueError):
        return None
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    unigram = float(-np.log(counts[rows] / counts.sum()).mean()) if rows.size else None
    return {"uniform": math.log(vocab_size), "unigram": unigram, "eval_tokens": int(rows.size)}
