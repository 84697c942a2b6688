"""The one training step, for both trainers and the lab's trials (torchtitan's train_step, nanoGPT's loop): backward
over the step's micro-batches, then clip, the finite guard, the optimizer step and the schedule step.

Two thin backends say how each piece runs:
- `AccelerateBackend`, for the trainers: accelerate scales the loss (1 / accumulation, fp16's loss scale), syncs
  DDP on the last micro-batch, and DeepSpeed clips and steps inside its own engine;
- `TorchBackend`, for a trial's process: plain torch, with a GradScaler when the trial runs fp16.

The clip bound is `GradClipper`'s (fixed or adaptive, by norm or by value). What stays with the callers: the run
folder, resume and logging (`session.TrainingSession`); a trial's fail-safes,
retry and measurements, the last as an `inspect` hook that sees the clipped gradients before the update.

The step reads nothing back to the host: its losses, gradient norm and flags stay tensors on the device
(`StepOutput`), so a GPU never waits for the CPU between steps. The trainers read them a window of steps at a time
(`TrainingSession.collect`, at their log, eval and save steps); a trial reads each step with `read()`, one sync.
What still syncs, and why: an optimizer that cannot skip an update on the device (anything but torch's fused
kernels: `skips_on_device`) reads the finite guard once; adaptive clipping reads the norm it remembers; a trial's
fp16 scaler reads its scale (`bench/host_syncs.py` counts them).
"""

from __future__ import annotations

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
class StepValues:
    """A step's outcome read back to the host (`StepOutput.read`)."""

    losses: list[float]  # each micro-batch's loss, in order
    grad_norm: Optional[float]  # before clipping; None when DeepSpeed clips inside its own step
    lr: float  # the lr this step used (the first param group's)
    stepped: bool  # False when a non-finite loss or gradient kept the update off the weights
    clipped: bool  # whether the clip bound was active
    overflow: bool  # fp16: the loss scaler found an inf/NaN gradient and skipped the update


@dataclass
class StepOutput:
    """A step's outcome as the device holds it (tensors: reading one is a host sync)."""

    losses: torch.Tensor  # each micro-batch's loss, in order (float32, 1-D)
    grad_norm: Optional[torch.Tensor]  # before clipping; None when DeepSpeed clips inside its own step
    lr: float
    stepped: torch.Tensor | bool
    clipped: torch.Tensor | bool
    overflow: torch.Tensor | bool

    def flags(self) -> torch.Tensor:
        """[loss sum, grad norm (NaN if none), stepped, clipped, overflow] as one float64 tensor on the device."""
        device = self.losses.device
        norm = self.grad_norm if self.grad_norm is not None else float("nan")
        parts = (self.losses.sum(), norm, self.stepped, self.clipped, self.overflow)
        return torch.stack([torch.as_tensor(part, device=device).double() for part in parts])

    def read(self) -> StepValues:
        """Everything at once, in one host sync."""
        *losses, _, norm, stepped, clipped, overflow = torch.cat([self.losses.double(), self.flags()]).tolist()
        grad_norm = None if self.grad_norm is None else norm
        return StepValues(losses, grad_norm, self.lr, bool(stepped), bool(clipped), bool(overflow))


def skips_on_device(optimizer) -> bool:
    """torch's fused Adam/AdamW/SGD take GradScaler's `found_inf` and skip the whole update inside the kernel (the
    step count too), so the finite guard needs no host sync; any other optimizer is stepped only after reading it."""
    inner = innermost(optimizer)
    return bool(getattr(inner, "defaults", {}).get("fused")) and getattr(inner, "_step_supports_amp_scaling", False)


def disarm(optimizer) -> None:
    """Take the on-device guard off again (GradScaler deletes its own after each step too)."""
    inner = innermost(optimizer)
    for name in ("grad_scale", "found_inf"):
        if hasattr(inner, name):
            delattr(inner, name)


def innermost(optimizer):
    """The optimizer doing the update inside accelerate's (and DeepSpeed's) wrappers (e.g. DeepSpeedCPUAdam under
    ZeRO offload)."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


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

    @property
    def steps_in_backward(self) -> bool:
        """DeepSpeed clips and steps inside its engine during backward; the wrapper's step does nothing."""
        return self.accelerator.distributed_type.value == "DEEPSPEED"

    def scaled_update(self, optimizer, finite: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        optimizer.step()  # through accelerate's scaler; a fused optimizer skips an overflow on the device
        skipped = optimizer.step_was_skipped  # an unfused optimizer's skip, which the scaler decided on the host
        return finite & (not skipped), ~finite | skipped


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

    steps_in_backward = False

    def scaled_update(self, optimizer, finite: torch.Tensor) -> tuple[torch.Tensor, bool]:
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        overflow = self.scaler.get_scale() < before
        return finite & (not overflow), overflow


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
        finite = torch.isfinite(losses).all()
        if norm is not None:
            finite = finite & torch.isfinite(norm)
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
            if self._update_allowed(optimizer, finite):
                try:
                    optimizer.step()
                finally:
                    disarm(optimizer)
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if norm is not None and clipper.mode == "adaptive":
            clipper.observe(float(norm))  # the bound it remembers is read back: adaptive clipping's one sync
        return StepOutput(losses, norm, lr, stepped, clipped, overflow)

    def _update_allowed(self, optimizer, finite: torch.Tensor) -> bool:
        """Whether to call the optimizer's step, unless a loss or the gradient is non-finite. DeepSpeed has stepped
        inside its engine already (the wrapper's step does nothing); a fused torch optimizer is armed to skip on the
        device (GradScaler's `found_inf`, without a scale); any other optimizer reads the guard: its one host sync."""
        if self.backend.steps_in_backward:
            return True
        if skips_on_device(optimizer):
            inner = innermost(optimizer)
            inner.grad_scale, inner.found_inf = None, (~finite).float()
            return True
        return bool(finite)

    def _clip(self, params, optimizer, clipper, step: int) -> tuple[Optional[torch.Tensor], torch.Tensor | bool]:
        bound = clipper.max_norm(step)
        by_value = clipper.clip_mode == "value" and bound
        # value clipping measures the norm first, for the record (an inf bound leaves the gradients as they are)
        norm = self.backend.clip_grad_norm_(params, optimizer, float("inf") if by_value else bound or float("inf"))
        if norm is None:  # DeepSpeed clips inside its own step
            return None, False
        norm = norm.detach().float() if torch.is_tensor(norm) else torch.tensor(float(norm))  # DeepSpeed's is a float
        if not by_value:
            return norm, norm > bound if bound is not None else False
        self.backend.clip_grad_value_(params, bound)
        grads = [p.grad for p in params if p.grad is not None]
        return norm, torch.stack([(g.abs() >= bound).any() for g in grads]).any() if grads else False
