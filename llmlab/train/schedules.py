"""The schedules' formulas (transformers' linear / cosine / polynomial / constant, written out once so every schedule
has the same warmup and floor). Torch-free: train/optim.py wraps them in a LambdaLR, and configs, the lab's report
and scripts/findings.py use them without loading the training stack."""
from __future__ import annotations

import math

POLYNOMIAL_POWER = 2.0  # power 1 would equal linear


def lr_multiplier(step: int, name: str, warmup: int, total: int, min_lr_ratio: float = 0.0) -> float:
    """The schedule's factor on the peak lr at `step` (0-based, as LambdaLR counts)."""
    if step < warmup:
        return step / max(1, warmup)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = {"linear": 1.0 - progress, "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
             "polynomial": (1.0 - progress) ** POLYNOMIAL_POWER, "constant": 1.0}[name]
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def mean_lr_share(name: str, steps: int = 1000) -> float:
    """Mean multiplier of a schedule over a run without warmup and floor: how much of the peak lr it spends."""
    return sum(lr_multiplier(s, name, 0, steps) for s in range(steps)) / steps
