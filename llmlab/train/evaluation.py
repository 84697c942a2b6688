"""Validation loss of a model on token rows, overall and per position segment, with its last attention layer's
entropy: what every lab trial reports at its end."""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from llmlab.models.minimal import MinimalTransformer
from llmlab.train.loss import perplexity


def evaluate_rows(
    model, rows: np.ndarray, micro: int, device, autocast: Optional[Callable] = None, segments: int = 4
) -> dict:
    """Validation loss / perplexity overall and per position segment, and the last layer's attention entropy."""
    model.eval()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    token_losses, entropies = [], []
    with torch.no_grad(), (autocast or contextlib.nullcontext)():
        for start in range(0, len(rows), micro):
            ids = torch.from_numpy(np.asarray(rows[start : start + micro], dtype=np.int64)).to(device)
            if isinstance(model, MinimalTransformer):
                logits, entropy = model(ids, return_attention_entropy=True)
                entropies.append(float(entropy))
            else:  # HF models: the last layer's attention probabilities need the eager attention path
                out = model(ids, output_attentions=True)
                logits = out.logits
                if out.attentions:
                    probs = out.attentions[-1].float()
                    entropies.append(float(-(probs * probs.clamp_min(1e-12).log()).sum(-1).mean()))
            losses = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
            token_losses.append(losses.cpu())
    model.train()
    per_token = torch.cat(token_losses)  # [rows, predicted positions 2..block_size]
    bounds = np.linspace(0, per_token.size(1), segments + 1).astype(int)
    by_segment = {
        f"{bounds[i] + 2}-{bounds[i + 1] + 1}": float(per_token[:, bounds[i] : bounds[i + 1]].mean())
        for i in range(segments)
    }
    val_loss = float(per_token.mean())
    return {
        "val_loss": val_loss,
        "val_perplexity": perplexity(val_loss),
        "val_loss_by_position": by_segment,
        "val_perplexity_by_position": {k: perplexity(v) for k, v in by_segment.items()},
        "attention_entropy_last_layer": float(np.mean(entropies)) if entropies else None,
    }
