"""The lab's fail-safes: what stops a trial that cannot give a useful answer (a diverging, exploding or flat loss, a
run that would not fit its timeout), without firing on the noise of a healthy one, and the one retry's fallback."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import replace
from typing import Callable

import numpy as np

from llmlab.sweep.spec import SLOW_PRECHECK, Hparams, TrialSpec

FAIL_SMOOTH = 10  # losses in the fail-safes' moving average: one noisy batch moves it by a tenth


class TrialStop(Exception):
    """A fail-safe tripped; `reason` names which one and `kind` picks the fallback."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


class FailSafes:
    """Stops a trial that cannot give a useful answer, without firing on the noise of a healthy one.

    Divergence is judged on the moving average of the last `smooth` losses: it must rise more than
    `margin` above its best value so far, or above `ceiling` (default: the untrained loss + 1, i.e. worse
    than a model that never trained). One noisy batch moves that average by ~1/smooth of its excursion."""

    def __init__(self, spec: TrialSpec, probe_loss: Callable[[], float]):
        self.spec, self.probe_loss = spec, probe_loss
        self.recent: deque[float] = deque(maxlen=FAIL_SMOOTH)
        self.best, self.ceiling, self.probes = math.inf, spec.fail_loss, []

    def check(self, step: int, loss: float, norm: float, overflow: bool) -> None:
        if not math.isfinite(loss):
            raise TrialStop("diverged", f"loss is {loss} at step {step}")
        self.recent.append(loss)
        smoothed = sum(self.recent) / len(self.recent)
        if self.ceiling is None:
            self.ceiling = loss + 1.0
        margin = self.spec.fail_margin
        if smoothed > self.ceiling:
            raise TrialStop("diverged", f"smoothed loss {smoothed:.3f} > {self.ceiling:.3f} at step {step}")
        if smoothed > self.best + margin:
            raise TrialStop(
                "diverged",
                f"smoothed loss {smoothed:.3f} rose more than {margin:g} above its best {self.best:.3f} (step {step})",
            )
        if len(self.recent) == self.recent.maxlen:  # the best of full windows only: the start is noisy
            self.best = min(self.best, smoothed)
        if not overflow and not math.isfinite(norm):
            raise TrialStop("diverged", f"gradient norm is {norm} at step {step}")
        if math.isfinite(norm) and norm > self.spec.fail_grad_norm:
            raise TrialStop("diverged", f"gradient norm {norm:.1f} > {self.spec.fail_grad_norm:g} at step {step}")
        if step % self.spec.flat_window == 0:
            self.probes.append(self.probe_loss())
            moved = abs(self.probes[-1] - self.probes[-2]) if len(self.probes) >= 2 else math.inf
            if moved < self.spec.flat_tolerance:
                raise TrialStop(
                    "flat",
                    f"probe loss moved {moved:.2e} < {self.spec.flat_tolerance:g} over "
                    f"{self.spec.flat_window} steps (step {step})",
                )


def precheck(spec: TrialSpec, step: int, step_times: list[float], started: float) -> None:
    if step + 1 != spec.precheck_steps:
        return
    # the median ignores the first step's one-off costs (torch.compile, allocator warm-up)
    projected = (time.time() - started) + (spec.steps - step - 1) * float(np.median(step_times))
    if projected > spec.timeout_s:
        raise TrialStop(
            "slow",
            f"pre-check: projected {projected:.0f} s {SLOW_PRECHECK} "
            f"{spec.timeout_s} s; lower --steps or raise --trial_timeout",
        )


def fallback(hp: Hparams, stop: TrialStop) -> tuple[Hparams, str] | None:
    """The one retry: a flat loss first tries warmup 100 (the lr rises sooner), a divergence clip - 0.1."""
    if stop.kind == "slow":
        return None
    options = []
    if isinstance(hp.clip, (int, float)) and hp.clip > 0.1:
        tighter = round(hp.clip - 0.1, 6)
        options.append((replace(hp, clip=tighter), f"clip {hp.clip} -> {tighter}"))
    if hp.warmup > 100:
        options.append((replace(hp, warmup=100), f"warmup {hp.warmup} -> 100"))
    if stop.kind == "flat":
        options.reverse()
    return options[0] if options else None
