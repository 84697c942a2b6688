"""One optimizer and schedule vocabulary for pretraining, LoRA and the lab's trials.

Optimizers: AdamW (torch, fused kernel), Lion (lion-pytorch), Adafactor (transformers, with a fixed lr: no relative
step, no parameter scaling, so a schedule applies to it like to the others).

Lion's convention, stated once: a run gives every optimizer the same --learning_rate and --weight_decay; Lion takes
lr / LION_LR_DIVISOR and weight decay x LION_LR_DIVISOR of them (its authors: an lr 3-10x smaller than AdamW's and a
weight decay 3-10x larger, which keeps lr x wd, the decay per step), so one setting means a comparable step for all.

Weight decay applies to matrices only (ndim >= 2): never to biases or LayerNorm gains.

Schedules: linear, cosine, polynomial (power 2) and constant, each after a linear warmup, decaying to a floor
(`min_lr_ratio` x the peak lr). The multipliers are transformers' formulas, written out once so every schedule
has the same warmup and floor.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
from torch.optim.lr_scheduler import LambdaLR

OPTIMIZERS = ("adamw", "lion", "adafactor")
SCHEDULERS = ("linear", "cosine", "polynomial", "constant")
LION_LR_DIVISOR = 3.0  # lion-pytorch README: lr 3-10x smaller than AdamW, weight decay 3-10x larger
POLYNOMIAL_POWER = 2.0  # power 1 would equal linear


def param_groups(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float,
                 lr_multipliers: Optional[dict[int, float]] = None) -> list[dict]:
    """Matrices decay, vectors do not; `lr_multipliers` (id(param) -> factor) give muP's per-layer lrs. Group 0 (the
    lr the logs report) is the decayed, unscaled one: the lr the user set."""
    buckets: dict[tuple[bool, float], list] = {}
    for p in params:
        if p.requires_grad:
            buckets.setdefault((p.ndim >= 2, (lr_multipliers or {}).get(id(p), 1.0)), []).append(p)
    return [{"params": group, "weight_decay": weight_decay if decay else 0.0, "lr": lr * mult}
            for (decay, mult), group in sorted(buckets.items(), key=lambda kv: (not kv[0][0], kv[0][1] != 1.0))]


def build_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float,
                    betas: Optional[tuple[float, float]] = None, eps: Optional[float] = None,
                    lr_multipliers: Optional[dict[int, float]] = None) -> torch.optim.Optimizer:
    """`betas` / `eps` unset: each optimizer's own defaults (AdamW 0.9/0.999, 1e-8; Lion 0.9/0.99)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; one of {', '.join(OPTIMIZERS)}")
    if name == "lion":
        lr, weight_decay = lr / LION_LR_DIVISOR, weight_decay * LION_LR_DIVISOR
    groups = param_groups(params, lr, weight_decay, lr_multipliers)
    if name == "adamw":
        extra = {k: v for k, v in (("betas", betas), ("eps", eps)) if v is not None}
        return torch.optim.AdamW(groups, lr=lr, fused=True, **extra)  # one kernel for all tensors, CPU and GPU
    if name == "lion":
        from lion_pytorch import Lion

        return Lion(groups, lr=lr, **({"betas": betas} if betas is not None else {}))
    from transformers.optimization import Adafactor

    return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)


def lr_multiplier(step: int, name: str, warmup: int, total: int, min_lr_ratio: float = 0.0) -> float:
    """The schedule's factor on the peak lr at `step` (0-based, as LambdaLR counts)."""
    if step < warmup:
        return step / max(1, warmup)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = {"linear": 1.0 - progress, "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
             "polynomial": (1.0 - progress) ** POLYNOMIAL_POWER, "constant": 1.0}[name]
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_schedule(optimizer: torch.optim.Optimizer, name: str, warmup: int, total: int,
                   min_lr_ratio: float = 0.0) -> LambdaLR:
    if name not in SCHEDULERS:
        raise ValueError(f"unknown schedule {name!r}; one of {', '.join(SCHEDULERS)}")
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, name, warmup, total, min_lr_ratio))


def check_deepspeed_choices(accelerator, optimizer: str, clip_mode: str) -> None:
    """DeepSpeed's config keeps `optimizer: auto` (accelerate hands it our AdamW, and ZeRO offload swaps in its CPU
    Adam); Lion and Adafactor are not wired through that path, and it clips the global norm only: refuse those."""
    from llmlab.core.errors import UserError

    if accelerator.state.deepspeed_plugin is None:
        return
    if optimizer != "adamw":
        raise UserError(f"--optimizer {optimizer} is not available under DeepSpeed here (its ZeRO offload runs its own "
                        "Adam); use --optimizer adamw, or launch without the DeepSpeed config")
    if clip_mode != "norm":
        raise UserError("--clip_mode value is not available under DeepSpeed (it clips the global norm inside its own "
                        "step); use --clip_mode norm")


def mean_lr_share(name: str, steps: int = 1000) -> float:
    """Mean multiplier of a schedule over a run without warmup and floor: how much of the peak lr it spends."""
    return sum(lr_multiplier(s, name, 0, steps) for s in range(steps)) / steps
