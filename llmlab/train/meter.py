"""The training meter: owns the logging cadence (torchtitan's metrics processor), so the session does not.

Between two logs it sums the steps' losses, tokens, wall time and data-loader wait (the window); every
`log_every` steps (its LoggingGroup), and at the last, it logs their means, tokens/s and MFU through the session's
trackers and shows them on the progress bar. Evaluation, sampling and saving run inside `paused()`, so they never
count as training time.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Optional

from llmlab.core.io import progress_bar
from llmlab.train.config import LoggingGroup


def _empty_window() -> dict[str, float]:
    return {"loss": 0.0, "micro": 0, "tokens": 0, "seconds": 0.0, "data_wait": 0.0, "steps": 0}


class StepMeter:
    def __init__(
        self,
        state,
        log: Callable[[dict[str, Any]], None],
        total_steps: int,
        desc: str,
        show_bar: bool,
        num_processes: int = 1,
        logging: LoggingGroup = LoggingGroup(),
    ):
        """`state` is the run's LoopState (its step and tokens_seen, restored by a resume or a rollback); `log`
        sends a dict of values to the trackers."""
        self.state, self.log, self.total_steps, self.num_processes = state, log, total_steps, num_processes
        self.every = logging.log_every
        self.flops_per_token: Optional[float] = None  # set by a trainer that knows its model's FLOPs
        self.peak_flops: Optional[float] = None
        self.bar = progress_bar(total=total_steps, initial=state.step, desc=desc, disable=not show_bar)
        self._window, self._tick = _empty_window(), time.perf_counter()

    def add(self, loss_sum: float, micro_batches: float, tokens: float) -> None:
        """One optimizer step's loss sum, micro-batch count and tokens, summed over the processes."""
        window = self._window
        window["loss"] += loss_sum
        window["micro"] += micro_batches
        window["tokens"] += tokens

    def tick(self) -> None:
        """One optimizer step ended: its time into the window, the bar one on."""
        now = time.perf_counter()
        self._window["seconds"] += now - self._tick
        self._window["steps"] += 1
        self._tick = now
        self.bar.update(1)

    def log_step(self, result, extra: Optional[dict] = None) -> None:
        """When a log is due, the window's mean loss and tokens/s, with the step `result`'s lr and gradient norm."""
        window = self._window
        if not self.due(self.state.step):
            return
        tokens_per_sec = window["tokens"] / max(window["seconds"], 1e-9)
        metrics = {
            "train/loss": window["loss"] / max(window["micro"], 1),
            "train/lr": result.lr,
            "train/grad_norm": result.grad_norm,
            "train/tokens_per_sec": tokens_per_sec,
            "train/tokens_seen": self.state.tokens_seen,
            # time the step waited for its batches: the loader holds training back when this share grows
            "train/data_wait_ms": 1000 * window["data_wait"] / max(window["steps"], 1),
            "train/data_wait_share": window["data_wait"] / max(window["seconds"], 1e-9),
            **(extra or {}),
        }
        if self.flops_per_token and self.peak_flops:
            metrics["train/mfu"] = tokens_per_sec * self.flops_per_token / (self.peak_flops * self.num_processes)
        self.log(metrics)
        self.bar.set_postfix(
            loss=f"{metrics['train/loss']:.4f}", lr=f"{result.lr:.2e}", tok_s=f"{tokens_per_sec:,.0f}", refresh=False
        )  # shown with the next update: a log file gets no extra frame
        self._window = _empty_window()

    def waited(self, seconds: float) -> None:
        """Time spent waiting for the data loader inside the current step."""
        self._window["data_wait"] += seconds

    @contextmanager
    def paused(self):
        """Evaluation, sampling and saving are not training: keep their time out of tokens/s."""
        try:
            yield
        finally:
            self._tick = time.perf_counter()

    def discard_window(self) -> None:
        """Forget the steps since the last log (e.g. the steps a rollback undid)."""
        self._window, self._tick = _empty_window(), time.perf_counter()

    def due(self, step: int) -> bool:
        """A log is due every `log_every` steps and at the last."""
        return (self.every > 0 and step % self.every == 0) or step == self.total_steps

    def close(self) -> None:
        self.bar.close()
