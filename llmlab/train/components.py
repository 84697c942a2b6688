"""The optimizers and lr schedules a run can use, one entry each, with what the rest of the project needs to know.

An optimizer entry holds its builder, its state in bytes per parameter (for recommend's memory model), whether
DeepSpeed's ZeRO path runs it, and its lr convention. A schedule entry holds its shape (the factor on the peak lr
as training progresses), from which its mean-lr share follows. The trainers' `--optimizer` / `--lr_scheduler`
choices, the lab's factor levels, recommend and the memory model all read these tables, so adding an optimizer or
a schedule is one `register_*` call plus its test.

Lion's convention, stated once: a run gives every optimizer the same --learning_rate and --weight_decay; Lion takes
lr / 3 and weight decay x 3 of them (its authors: an lr 3-10x smaller than AdamW's and a weight decay 3-10x larger,
which keeps lr x wd, the decay per step), so one setting means a comparable step for all.

Torch-free at import (configs read it before the training stack loads): each builder imports its library.
"""

from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class OptimizerEntry:
    build: Callable[..., Any]  # (param_groups, lr, betas, eps) -> a torch optimizer; lr already follows lr_divisor
    state_bytes: float  # optimizer state per parameter at fp32, for the memory model
    deepspeed: bool  # DeepSpeed's ZeRO path (accelerate hands it this optimizer; offload swaps in its CPU Adam) runs it
    lr_divisor: float = 1.0  # it takes lr / lr_divisor and weight decay x lr_divisor of the run's settings
    label: str = ""  # its name in prose (reports)
    about: str = ""
    hidden_matrices: bool = False  # it steps the model's hidden matrices apart (build gets them marked `muon`)


@dataclass(frozen=True)
class ScheduleEntry:
    shape: Callable[..., float]  # progress in [0, 1] after warmup (+ its options) -> the factor on the peak lr
    about: str = ""
    options: tuple[str, ...] = ()  # the keyword options its shape takes (the trainers' --decay_fraction, ...)

    def mean_lr_share(self, steps: int = 1000, **options) -> float:
        """Mean factor over a run without warmup and floor: how much of the peak lr the schedule spends."""
        return sum(self.at(min(1.0, s / max(1, steps)), options) for s in range(steps)) / steps

    def at(self, progress: float, options: Optional[dict] = None) -> float:
        return self.shape(progress, **{k: v for k, v in (options or {}).items() if k in self.options})


OPTIMIZERS: dict[str, OptimizerEntry] = {}
SCHEDULES: dict[str, ScheduleEntry] = {}


def register_optimizer(name: str, entry: OptimizerEntry) -> None:
    OPTIMIZERS[name] = entry


def register_schedule(name: str, entry: ScheduleEntry) -> None:
    SCHEDULES[name] = entry


def _adamw(groups, lr: float, betas: Optional[tuple], eps: Optional[float], fused: bool = True):
    import torch

    extra = {k: v for k, v in (("betas", betas), ("eps", eps)) if v is not None}
    # fused: one kernel for all tensors, CPU and GPU, which also skips a non-finite step on the device
    return torch.optim.AdamW(groups, lr=lr, fused=fused, foreach=None if fused else True, **extra)


def _adamw_foreach(groups, lr: float, betas: Optional[tuple], eps: Optional[float]):
    return _adamw(groups, lr, betas, eps, fused=False)


def _lion(groups, lr: float, betas: Optional[tuple], eps: Optional[float]):
    from lion_pytorch import Lion

    return Lion(groups, lr=lr, **({"betas": betas} if betas is not None else {}))


def _adafactor(groups, lr: float, betas: Optional[tuple], eps: Optional[float]):
    from transformers.optimization import Adafactor  # loads Trainer utilities and peft: 2.4 s, so only when chosen

    # a fixed lr (no relative step, no parameter scaling), so a schedule applies to it like to the others
    return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)


register_optimizer(
    "adamw", OptimizerEntry(_adamw, state_bytes=8.0, deepspeed=True, label="AdamW", about="torch, fused kernel")
)
register_optimizer(
    "adamw-foreach",
    OptimizerEntry(
        _adamw_foreach,
        state_bytes=8.0,
        deepspeed=False,
        label="AdamW (foreach)",
        about="torch's unfused multi-tensor AdamW (HF's adamw_torch): the fused kernel's baseline",
    ),
)
register_optimizer(
    "lion",
    OptimizerEntry(
        _lion,
        state_bytes=4.0,
        deepspeed=False,
        lr_divisor=3.0,
        label="Lion",
        about="lion-pytorch; takes lr / 3 and weight decay x 3",
    ),
)
register_optimizer(
    "adafactor",
    OptimizerEntry(
        _adafactor, state_bytes=0.0, deepspeed=False, label="Adafactor", about="transformers, at a fixed lr"
    ),
)


def _muon(groups, lr: float, betas: Optional[tuple], eps: Optional[float]):
    from llmlab.train.muon import MuonAdamW  # torch at import; this module is read before the training stack loads

    return MuonAdamW(groups, lr, betas, eps)


register_optimizer(
    "muon",
    OptimizerEntry(
        _muon,
        state_bytes=8.0,  # a bound: AdamW's 8 bytes on embeddings and norms, Muon's momentum (4) on hidden matrices
        deepspeed=False,
        label="Muon",
        about="torch's Muon (Nesterov 0.95, 5 Newton-Schulz steps, AdamW-matched lr) on hidden matrices, fused QKV "
        "as its three matrices; AdamW on embeddings, head, norms and biases (nanochat, modded-nanogpt)",
        hidden_matrices=True,
    ),
)

# transformers' formulas, written out once so every schedule has the same warmup and floor
POLYNOMIAL_POWER = 2.0  # power 1 would equal linear
register_schedule("linear", ScheduleEntry(lambda progress: 1.0 - progress, "linear decay"))
register_schedule("cosine", ScheduleEntry(lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)), "cosine"))
register_schedule("polynomial", ScheduleEntry(lambda progress: (1.0 - progress) ** POLYNOMIAL_POWER, "power 2"))
register_schedule("constant", ScheduleEntry(lambda progress: 1.0, "constant after warmup"))

# warmup-stable-decay (MiniCPM 2024; nanochat's warmdown): the peak lr until the last `decay_fraction` of the run, then
# down to the floor. Its stable trunk can be resumed with another length, or branched into cooldowns of several.
DECAY_SHAPES = {
    "linear": lambda x: 1.0 - x,  # nanochat, modded-nanogpt
    "cosine": lambda x: 0.5 * (1.0 + math.cos(math.pi * x)),
    "sqrt": lambda x: 1.0 - math.sqrt(x),  # "1 - sqrt" (Hagele et al. 2024): the lowest loss of their cooldowns
}
DEFAULT_DECAY_FRACTION, DEFAULT_DECAY_SHAPE = 0.2, "linear"  # nanochat's warmdown_ratio, linear to the floor


def _wsd(progress: float, decay_fraction: float = DEFAULT_DECAY_FRACTION, decay_shape: str = DEFAULT_DECAY_SHAPE):
    start = 1.0 - decay_fraction
    if progress <= start or decay_fraction <= 0:
        return 1.0
    return DECAY_SHAPES[decay_shape](min(1.0, (progress - start) / decay_fraction))


register_schedule(
    "wsd",
    ScheduleEntry(
        _wsd,
        "warmup-stable-decay: constant, then --decay_shape over the last --decay_fraction",
        options=("decay_fraction", "decay_shape"),
    ),
)


def load_plugins() -> None:
    """LLMLAB_PLUGINS=pkg.mod,other: modules that register components of their own when imported (`register_*`
    calls at their top level), so a new optimizer or schedule needs no edit here. Read in every process that imports
    this module: the trainers, `accelerate launch` ranks and the lab's trial processes alike (like torchtitan's
    --experimental.custom_import)."""
    for name in filter(None, (part.strip() for part in os.environ.get("LLMLAB_PLUGINS", "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as err:  # at import time, before any script's error handler: exit with the one line
            raise SystemExit(
                f"error: LLMLAB_PLUGINS: cannot import {name!r} ({err}); put it on PYTHONPATH, or unset LLMLAB_PLUGINS"
            ) from None


load_plugins()


def lr_multiplier(
    step: int, name: str, warmup: int, total: int, min_lr_ratio: float = 0.0, options: Optional[dict] = None
) -> float:
    """The schedule's factor on the peak lr at `step` (0-based, as LambdaLR counts); `options` are the schedule's own
    (a wsd's decay_fraction and decay_shape), the others ignored."""
    if step < warmup:
        return step / max(1, warmup)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr_ratio + (1.0 - min_lr_ratio) * SCHEDULES[name].at(progress, options)


def mean_lr_share(name: str, steps: int = 1000) -> float:
    """Mean multiplier of a schedule over a run without warmup and floor: how much of the peak lr it spends."""
    return SCHEDULES[name].mean_lr_share(steps)
