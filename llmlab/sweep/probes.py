"""The lab's probes: what a trial measures beyond its loss (gradient and update ratios per layer group, a fixed
validation batch's loss for the flat-loss check, the last attention layer's entropy)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from llmlab.models.minimal import MinimalTransformer
from llmlab.sweep import metrics as M
from llmlab.train.loss import causal_lm_loss


def forward_logits(model, input_ids):
    out = model(input_ids)
    return out.logits if hasattr(out, "logits") else out


def grad_param_ratios(model) -> dict[str, float]:
    """|grad| / |param| per layer group (the original lab's update ratio), from the gradients the step applies."""
    sums: dict[str, list[float]] = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            group = sums.setdefault(M.layer_group(name), [0.0, 0.0])
            group[0] += float(param.grad.detach().float().pow(2).sum())
            group[1] += float(param.detach().float().pow(2).sum())
    return {g: math.sqrt(u) / math.sqrt(p) for g, (u, p) in sums.items() if p > 0}


def update_ratios(model, before: dict[str, torch.Tensor]) -> dict[str, float]:
    """|update| / |param| per layer group, from a snapshot taken just before optimizer.step()."""
    sums: dict[str, list[float]] = {}
    for name, param in model.named_parameters():
        if name in before:
            group = sums.setdefault(M.layer_group(name), [0.0, 0.0])
            group[0] += float((param.detach() - before[name]).float().pow(2).sum())
            group[1] += float(before[name].float().pow(2).sum())
    return {g: math.sqrt(u) / math.sqrt(p) for g, (u, p) in sums.items() if p > 0}


def probe_loss(model, autocast, probe: torch.Tensor) -> float:
    """Loss on a fixed validation batch (not through the compiled loss: eval mode and this shape would recompile)."""
    model.eval()
    with torch.no_grad(), autocast():
        value = float(causal_lm_loss(forward_logits(model, probe), probe))
    model.train()
    return value


def probe_entropy(model, autocast, probe: torch.Tensor) -> Optional[float]:
    """The last attention layer's mean entropy on the probe batch, during training (the original lab's curve)."""
    model.eval()
    try:
        with torch.no_grad(), autocast():
            if isinstance(model, MinimalTransformer):
                return float(model(probe, return_attention_entropy=True)[1])
            model.set_attn_implementation("eager")  # HF models expose attention probabilities only there
            probs = model(probe, output_attentions=True).attentions[-1].float()
            model.set_attn_implementation("sdpa")
            return float(-(probs * probs.clamp_min(1e-12).log()).sum(-1).mean())
    finally:
        model.train()
