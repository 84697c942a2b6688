"""The schedules' factor on the peak lr: a linear warmup, then the registered shape (llmlab.train.components), decaying
to a floor. Torch-free: train/optim.py wraps it in a LambdaLR, and configs, the lab's report and scripts/findings.py
use it without loading the training stack."""

from __future__ import annotations

from llmlab.train.components import POLYNOMIAL_POWER, SCHEDULES  # noqa: F401 (part of this module's API)


def lr_multiplier(step: int, name: str, warmup: int, total: int, min_lr_ratio: float = 0.0) -> float:
    """The schedule's factor on the peak lr at `step` (0-based, as LambdaLR counts)."""
    if step < warmup:
        return step / max(1, warmup)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr_ratio + (1.0 - min_lr_ratio) * SCHEDULES[name].shape(progress)


def mean_lr_share(name: str, steps: int = 1000) -> float:
    """Mean multiplier of a schedule over a run without warmup and floor: how much of the peak lr it spends."""
    return SCHEDULES[name].mean_lr_share(steps)
