"""Loss-spike detection for rollback, and the `--inject_spike` drill that lets you watch one happen."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass

from llmlab.core.errors import UserError


class SpikeDetector:
    """Flags a spike when the loss stays above `factor` x the mean of the previous normal steps (up to `window`
    of them) for `patience` consecutive steps. A NaN/inf loss always counts as a spiking step.

    Spiking steps are kept out of the reference window, so a long spike cannot raise its own bar. Detection
    arms after `arm_after` normal steps, before the window is full (OLMo-core's guard arms at half its window):
    spikes are most common early, in warmup, and a detector that waits for a full window never sees them.
    """

    def __init__(self, factor: float, window: int, patience: int, arm_after: int = 20):
        self.factor, self.window, self.patience = factor, window, patience
        self.arm_after = min(arm_after, window)
        self.history: deque[float] = deque(maxlen=window)
        self.streak = 0

    @property
    def armed(self) -> bool:
        return len(self.history) >= self.arm_after

    def is_spike(self, loss: float) -> bool:
        if not math.isfinite(loss):
            return True
        return self.armed and loss > self.factor * sum(self.history) / len(self.history)

    def update(self, loss: float) -> bool:
        """Record this step's loss; True when the spike has lasted `patience` steps (time to roll back)."""
        if self.is_spike(loss):
            self.streak += 1
        else:
            self.streak = 0
            self.history.append(loss)
        return self.streak >= self.patience

    def first_spike(self, losses: list[float]) -> int | None:
        """Feed a window of steps' losses in order; the index of the step that ended a spike's patience (the rest
        are not fed: the rollback restores the detector), or None."""
        for index, loss in enumerate(losses):
            if self.update(loss):
                return index
        return None

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


@dataclass
class RollbackState:
    """What rollbacks must remember across them (and across a resume): registered for checkpointing."""

    rollbacks: int = 0
    drill_done: bool = False

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.rollbacks, self.drill_done = int(state["rollbacks"]), bool(state["drill_done"])


def check_drill(drill: tuple[int, float] | None, save_every: int, arm_after: int) -> None:
    """A drill the run cannot answer is refused up front: it needs a checkpoint before it and an armed detector."""
    if drill is None:
        return
    step = drill[0]
    if step <= save_every:
        raise UserError(
            f"--inject_spike {step}: there is no checkpoint to roll back to before step {step} (the first "
            f"is saved at step {save_every}); inject after step {save_every} or lower --save_every"
        )
    if step <= arm_after:
        raise UserError(
            f"--inject_spike {step}: the spike detector arms after {arm_after} normal steps, so it cannot "
            f"see a spike at step {step}; inject at step {arm_after + 1} or later (or lower "
            "--spike_arm_steps)"
        )
