"""Building what the registries name (llmlab.train.components): one optimizer and schedule vocabulary for pretraining,
LoRA and the lab's trials.

Weight decay applies to matrices only (ndim >= 2): never to biases or LayerNorm gains. Every entry's lr convention
(`lr_divisor`: Lion takes lr / 3 and weight decay x 3) is applied here, once.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch.optim.lr_scheduler import LambdaLR

from llmlab.core.errors import UserError
from llmlab.train.components import OPTIMIZERS, SCHEDULES, lr_multiplier, mean_lr_share  # noqa: F401 (part of this module's API)  # noqa: F401 (part of this module's API)


def param_groups(
    params: Iterable[torch.nn.Parameter],
    lr: float,
    weight_decay: float,
    lr_multipliers: Optional[dict[int, float]] = None,
) -> list[dict]:
    """Matrices decay, vectors do not; `lr_multipliers` (id(param) -> factor) give muP's per-layer lrs. Group 0 (the
    lr the logs report) is the decayed, unscaled one: the lr the user set."""
    buckets: dict[tuple[bool, float], list] = {}
    for p in params:
        if p.requires_grad:
            buckets.setdefault((p.ndim >= 2, (lr_multipliers or {}).get(id(p), 1.0)), []).append(p)
    return [
        {"params": group, "weight_decay": weight_decay if decay else 0.0, "lr": lr * mult}
        for (decay, mult), group in sorted(buckets.items(), key=lambda kv: (not kv[0][0], kv[0][1] != 1.0))
    ]


def build_optimizer(
    name: str,
    params: Iterable[torch.nn.Parameter],
    lr: float,
    weight_decay: float,
    betas: Optional[tuple[float, float]] = None,
    eps: Optional[float] = None,
    lr_multipliers: Optional[dict[int, float]] = None,
    matrices: Optional[dict[int, tuple[int, int]]] = None,
) -> torch.optim.Optimizer:
    """`betas` / `eps` unset: each optimizer's own defaults (AdamW 0.9/0.999, 1e-8; Lion 0.9/0.99). `matrices`
    (id(param) -> (axis, matrices it fuses)) names the model's hidden matrices, which Muon steps apart."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; one of {', '.join(OPTIMIZERS)}")
    entry = OPTIMIZERS[name]
    lr, weight_decay = lr / entry.lr_divisor, weight_decay * entry.lr_divisor
    groups = param_groups(params, lr, weight_decay, lr_multipliers)
    if entry.hidden_matrices:
        groups = split_hidden_matrices(groups, matrices or {}, name)
    return entry.build(groups, lr, betas, eps)


def split_hidden_matrices(groups: list[dict], matrices: dict[int, tuple[int, int]], name: str) -> list[dict]:
    """Each group's hidden matrices in a group of their own, marked `muon` with each one's (axis, fused count)."""
    out = []
    for group in groups:
        hidden = [p for p in group["params"] if id(p) in matrices]
        rest = [p for p in group["params"] if id(p) not in matrices]
        if hidden:
            out.append({**group, "params": hidden, "muon": True, "blocks": [matrices[id(p)] for p in hidden]})
        if rest:
            out.append({**group, "params": rest})
    if not any(g.get("muon") for g in out):
        raise UserError(
            f"--optimizer {name} steps a model's hidden matrices, and none are among the parameters it trains "
            "(a LoRA adapter's low-rank factors are not hidden matrices); use --optimizer adamw"
        )
    return out


def build_schedule(
    optimizer: torch.optim.Optimizer,
    name: str,
    warmup: int,
    total: int,
    min_lr_ratio: float = 0.0,
    options: Optional[dict] = None,
) -> LambdaLR:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; one of {', '.join(SCHEDULES)}")
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, name, warmup, total, min_lr_ratio, options))


def check_deepspeed_choices(accelerator, optimizer: str, clip_mode: str) -> None:
    """DeepSpeed's config keeps `optimizer: auto` (accelerate hands it our optimizer, and ZeRO offload swaps in its
    CPU Adam); only entries marked `deepspeed` run that way, and it clips the global norm only: refuse the rest."""
    if accelerator.state.deepspeed_plugin is None:
        return
    if not OPTIMIZERS[optimizer].deepspeed:
        runs = ", ".join(name for name, entry in OPTIMIZERS.items() if entry.deepspeed)
        raise UserError(
            f"--optimizer {optimizer} is not available under DeepSpeed here (its ZeRO offload runs its own "
            f"Adam); use --optimizer {runs}, or launch without the DeepSpeed config"
        )
    if clip_mode != "norm":
        raise UserError(
            "--clip_mode value is not available under DeepSpeed (it clips the global norm inside its own "
            "step); use --clip_mode norm"
        )
