"""Small pieces both trainers share: gradient clipping (fixed or adaptive) and the causal-LM loss."""

from __future__ import annotations

import math
import os
from collections import deque
from typing import Optional

import torch
import torch.nn.functional as F
from accelerate.utils import InitProcessGroupKwargs

from llmlab.train.config import parse_clip


class GradClipper:
    """Clip bound for this step: fixed, or adaptive = factor × mean of the last `window` norms; applied to the
    global norm (`clip_mode` norm) or to every element (value).

    Adaptive clipping only starts after `warmup_steps` (early norms are large and unrepresentative);
    before that it clips at `fallback`. Feed each step's pre-clip norm back with `observe()`.
    """

    def __init__(
        self,
        clip: str | float,
        warmup_steps: int = 0,
        window: int = 50,
        factor: float = 1.5,
        fallback: float = 1.0,
        clip_mode: str = "norm",
    ):
        self.mode = parse_clip(clip)
        self.clip_mode = clip_mode
        self.warmup_steps = warmup_steps
        self.factor = factor
        self.fallback = fallback
        self.history: deque[float] = deque(maxlen=window)

    def max_norm(self, step: int) -> float | None:
        """The threshold to pass to clip_grad_norm_, or None to only measure the norm."""
        if self.mode == "adaptive":
            if step < self.warmup_steps or not self.history:
                return self.fallback
            return self.factor * sum(self.history) / len(self.history)
        return self.mode if self.mode > 0 else None

    def observe(self, grad_norm: float) -> None:
        if grad_norm == grad_norm and grad_norm != float("inf"):  # skip NaN/inf
            self.history.append(float(grad_norm))

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history.clear()
        self.history.extend(state.get("history", []))


def distributed_cpu() -> bool:
    """Several processes (accelerate launch, torchrun, deepspeed) and no GPU."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()


def process_group_handlers() -> list:
    """accelerate kwargs_handlers for this launch: gloo when several processes share no GPU.

    Without it accelerate silently runs each CPU rank as "process 0 of 1" on the same data; a single plain
    `python` process must not ask for a process group at all.
    """
    return [InitProcessGroupKwargs(backend="gloo")] if distributed_cpu() else []


def accelerator_placement() -> dict:
    """Accelerator kwargs that make several CPU processes one data-parallel run. Without `cpu=True` accelerate keeps
    distributed_type NO under `--multi_gpu` or torchrun on a CPU machine: prepare() skips DDP, gradients are never
    averaged, and each process trains its own model. DeepSpeed brings its own CPU backend and must not get it."""
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    return {"cpu": True} if distributed_cpu() and not deepspeed else {}


def next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """The labels of causal LM training: each position's next token, -100 (ignored) after the last."""
    return F.pad(input_ids, (0, 1), value=-100)[..., 1:]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Next-token cross-entropy; labels are the inputs (shifted here), -100 positions are ignored.

    The labels are shifted (padded with -100 at the end), not the logits: slicing the logits would copy the
    whole batch x seq x vocab tensor, which on GPT-2's 50k vocabulary costs a third of the loss time.
    """
    shift_labels = next_token_labels(labels)
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        shift_labels.reshape(-1),
        ignore_index=-100,
        label_smoothing=label_smoothing,
    )


def perplexity(loss: Optional[float]) -> Optional[float]:
    """exp(loss), capped where exp would overflow a float (~709); None for a missing or non-finite loss."""
    if loss is None or not math.isfinite(loss):
        return None
    return math.exp(min(loss, 700.0))
