"""The one training step, for both trainers and the lab's trials (torchtitan's train_step, nanoGPT's loop): backward
over the step's micro-batches, then clip, the finite guard, the optimizer step and the schedule step.

Two thin backends say how each piece runs:
- `AccelerateBackend`, for the trainers: accelerate scales the loss (1 / accumulation, fp16's loss scale), syncs
  DDP on the last micro-batch, and DeepSpeed clips and steps inside its own engine;
- `TorchBackend`, for a trial's process: plain torch, with a GradScaler when the trial runs fp16.

The clip bound is `GradClipper`'s (fixed or adaptive, by norm or by value). What stays with the callers: the run
folder, resume and logging (`session.TrainingSession`); a trial's fail-safes,
retry and measurements, the last as an `inspect` hook that sees the clipped gradients before the update.

Host syncs per step: one for the micro-batch losses (all at once, at the end of the step), one for the gradient
norm, and one for whether any element was clipped under value clipping; a trial's fp16 scaler reads its scale.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import torch

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


@dataclass
class StepOutput:
    losses: list[float]  # each micro-batch's loss, in order (one host sync for all of them)
    loss_sum: float  # their sum as the device adds them (the trainers' statistic)
    grad_norm: Optional[float]  # before clipping; None when DeepSpeed clips inside its own step
    lr: float  # the lr this step used (the first param group's)
    stepped: bool  # False when a non-finite loss or gradient kept the update off the weights
    clipped: bool  # whether the clip bound was active
    overflow: bool  # fp16: the loss scaler found an inf/NaN gradient and skipped the update


class AccelerateBackend:
    def __init__(self, accelerator):
        self.accelerator = accelerator

    def backward(self, loss: torch.Tensor, rows: int, of_rows: int) -> None:
        self.accelerator.backward(loss)  # accelerate divides by the accumulation steps itself

    def clip_grad_norm_(self, params, optimizer, max_norm: float):
        return self.accelerator.clip_grad_norm_(params, max_norm)  # unscales fp16 gradients first

    def clip_grad_value_(self, params, bound: float) -> None:
        self.accelerator.clip_grad_value_(params, bound)

    @property
    def scales_loss(self) -> bool:
        return self.accelerator.scaler is not None

    def scaled_update(self, optimizer, finite: bool) -> tuple[bool, bool]:
        optimizer.step()  # accelerate's optimizer steps through its scaler
        return finite and not optimizer.step_was_skipped, optimizer.step_was_skipped


class TorchBackend:
    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler

    def backward(self, loss: torch.Tensor, rows: int, of_rows: int) -> None:
        self.scaler.scale(loss * rows / of_rows).backward()  # micro-batches may differ in size: weight by rows

    def clip_grad_norm_(self, params, optimizer, max_norm: float):
        self.scaler.unscale_(optimizer)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def clip_grad_value_(self, params, bound: float) -> None:
        torch.nn.utils.clip_grad_value_(params, bound)

    @property
    def scales_loss(self) -> bool:
        return self.scaler.is_enabled()

    def scaled_update(self, optimizer, finite: bool) -> tuple[bool, bool]:
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        overflow = self.scaler.get_scale() < before
        return finite and not overflow, overflow


class Engine:
    """Micro-batches go in with `backward`; `step` clips, guards, updates and steps the schedule."""

    def __init__(self, backend):
        self.backend = backend
        self._losses: list[torch.Tensor] = []

    def backward(self, loss: torch.Tensor, rows: int = 1, of_rows: int = 1) -> None:
        self.backend.backward(loss, rows, of_rows)
        self._losses.append(loss.detach().float())

    def step(
        self, params, optimizer, scheduler, clipper, step: int, inspect: Optional[Callable[[], None]] = None
    ) -> StepOutput:
        """`inspect()` runs after clipping and before the update (a trial's gradient and update-ratio probes)."""
        params = list(params)
        norm, clipped = self._clip(params, optimizer, clipper, step)
        losses = torch.stack(self._losses)
        self._losses = []
        *values, loss_sum = torch.cat([losses, losses.sum()[None]]).tolist()
        finite = all(math.isfinite(v) for v in values) and (norm is None or math.isfinite(norm))
        if inspect is not None:
            inspect()
        lr = optimizer.param_groups[0]["lr"]
        if self.backend.scales_loss:
            # fp16: every step goes to the loss scaler. It skips a non-finite gradient and lowers the scale (the
            # first steps overflow by design); skipping its step here would leave it unscaled but not updated, and
            # the next unscale_ would fail.
            stepped, overflow = self.backend.scaled_update(optimizer, finite)
        else:
            stepped, overflow = finite, False
            if finite:
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if norm is not None:
            clipper.observe(norm)  # it ignores a non-finite norm
        return StepOutput(values, loss_sum, norm, lr, stepped, clipped, overflow)

    def _clip(self, params, optimizer, clipper, step: int) -> tuple[Optional[float], bool]:
        bound = clipper.max_norm(step)
        by_value = clipper.clip_mode == "value" and bound
        # value clipping measures the norm first, for the record (an inf bound leaves the gradients as they are)
        norm = self.backend.clip_grad_norm_(params, optimizer, float("inf") if by_value else bound or float("inf"))
        norm = float(norm) if norm is not None else None  # DeepSpeed clips inside its own step
        if not by_value:
            return norm, bound is not None and norm is not None and norm > bound
        self.backend.clip_grad_value_(params, bound)
        grads = [p.grad for p in params if p.grad is not None]
        return norm, bool(torch.stack([(g.abs() >= bound).any() for g in grads]).any()) if grads else False
