"""Evaluation, for the trainers and the lab's trials alike: the `Evaluator` component that owns an evaluation's
cadence, the trainers' validation loss (`validation_loss`), and a trial's validation on token rows, overall and
per position segment with its last attention layer's entropy (`evaluate_rows`)."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from llmlab.models.minimal import MinimalTransformer
from llmlab.train.config import EvalGroup
from llmlab.train.loss import perplexity


class Evaluator:
    """An evaluation that owns its cadence (torchtitan's validator): due every `eval_every` optimizer steps of its
    group and at the last (0: at the last only; `enabled` False: never). `maybe_run()` runs it when due, with the
    meter paused, so its time never counts as training. The session asks it, with the meter and the checkpointer,
    whether a step must read its values back (`TrainingSession.collect_due`)."""

    def __init__(self, session, group: EvalGroup, run: Callable[[], Any], enabled: bool = True):
        self.session, self.every, self.run, self.enabled = session, group.eval_every, run, enabled

    def due(self, step: int) -> bool:
        return self.enabled and ((self.every > 0 and step % self.every == 0) or step == self.session.total_steps)

    def maybe_run(self) -> Any:
        """The evaluation's result when it was due at this step, else None."""
        if not self.due(self.session.state.step):
            return None
        with self.session.meter.paused():
            return self.run()


@torch.no_grad()
def validation_loss(accelerator, model, val_dl, max_batches: int) -> float:
    """A trainer's validation loss: the mean loss of the first `max_batches` batches of `val_dl` through the loss
    wrapper (llmlab.train.loss.CausalLMWithLoss), never smoothed. The loader is not sharded: every process scores
    the same batches, so a validation loss means the same tokens at any world size."""
    model.eval()
    losses = []
    for i, batch in enumerate(val_dl):
        if i >= max_batches:
            break
        input_ids = batch["input_ids"].to(accelerator.device)
        loss = model(input_ids, label_smoothing=0.0)
        losses.append(loss.detach().float().reshape(1))
    return torch.cat(losses).mean().item() if losses else math.nan


def evaluate_rows(
    model, rows: np.ndarray, micro: int, device, autocast: Optional[Callable] = None, segments: int = 4
) -> dict:
    """A trial's validation: loss / perplexity overall and per position segment, and the last layer's attention
    entropy, from the full logits of a bare model (a registry build, not the loss wrapper)."""
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
