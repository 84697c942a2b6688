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

from typing import Iterable, Optional

import torch
from lion_pytorch import Lion
from torch.optim.lr_scheduler import LambdaLR

from llmlab.core.errors import UserError
from llmlab.train.config import LION_LR_DIVISOR, OPTIMIZERS, SCHEDULERS  # noqa: F401 (part of this module's API)
from llmlab.train.schedules import lr_multiplier, mean_lr_share  # noqa: F401 (part of this module's API)


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
        return Lion(groups, lr=lr, **({"betas": betas} if betas is not None else {}))
    from transformers.optimization import Adafactor  # here: it loads Trainer utilities and peft, 2.4 s per trial start

    return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)


def build_schedule(optimizer: torch.optim.Optimizer, name: str, warmup: int, total: int,
                   min_lr_ratio: float = 0.0) -> LambdaLR:
    if name not in SCHEDULERS:
        raise ValueError(f"unknown schedule {name!r}; one of {', '.join(SCHEDULERS)}")
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, name, warmup, total, min_lr_ratio))


def check_deepspeed_choices(accelerator, optimizer: str, clip_mode: str) -> None:
    """DeepSpeed's config keeps `optimizer: auto` (accelerate hands it our AdamW, and ZeRO offload swaps in its CPU
    Adam); Lion and Adafactor are not wired through that path, and it clips the global norm only: refuse those."""
    if accelerator.state.deepspeed_plugin is None:
        return
    if optimizer != "adamw":
        raise UserError(f"--optimizer {optimizer} is not available under DeepSpeed here (its ZeRO offload runs its own "
                        "Adam); use --optimizer adamw, or launch without the DeepSpeed config")
    if clip_mode != "norm":
        raise UserError("--clip_mode value is not available under DeepSpeed (it clips the global norm inside its own "
                        "step); use --clip_mode norm")
