"""Loss-spike detection for rollback, and the `--inject_spike` drill that lets you watch one happen."""
from __future__ import annotations

import math
from collections import deque

from llmlab.core.errors import UserError


class SpikeDetector:
    """Flags a spike when the loss stays above `factor` × the mean of the previous `window` normal steps
    for `patience` consecutive steps. A NaN/inf loss always counts as a spiking step.

    Spiking steps are kept out of the reference window, so a long spike cannot raise its own bar.
    Detection starts once the window is full.
    """

    def __init__(self, factor: float, window: int, patience: int):
        self.factor, self.window, self.patience = factor, window, patience
        self.history: deque[float] = deque(maxlen=window)
        self.streak = 0

    def is_spike(self, loss: float) -> bool:
        if not math.isfinite(loss):
            return True
        return len(self.history) == self.window and loss > self.factor * sum(self.history) / self.window

    def update(self, loss: float) -> bool:
        """Record this step's loss; True when the spike has lasted `patience` steps (time to roll back)."""
        if self.is_spike(loss):
            self.streak += 1
        else:
            self.streak = 0
            self.history.append(loss)
        return self.streak >= self.patience

    def state_dict(self) -> dict:
        return {"history": list(self.history), "streak": self.streak}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque(state.get("history", []), maxlen=self.window)
        self.streak = int(state.get("streak", 0))


def parse_inject_spike(value: str | None) -> tuple[int, float] | None:
    """`STEP[:FACTOR]` -> (step, factor); FACTOR defaults to 10."""
    if value in (None, ""):
        return None
    step_text, _, factor_text = str(value).partition(":")
    try:
        step, factor = int(step_text), float(factor_text or 10.0)
    except ValueError:
        raise UserError(f"--inject_spike: expected STEP[:FACTOR] like 50:10, got {value!r}") from None
    if step < 1 or factor <= 0:
        raise UserError(f"--inject_spike: STEP must be >= 1 and FACTOR > 0, got {value!r}")
    return step, factor
