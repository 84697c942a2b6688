"""Metrics to TensorBoard and to a metrics.jsonl next to it, through one call."""
from __future__ import annotations

import os
import time
from pathlib import Path

from llmlab.core.io import append_jsonl


class MetricsLogger:
    """`log({"train/loss": 2.3}, step)` writes TensorBoard scalars and one JSONL line.

    Only the main process should log; pass `enabled=False` elsewhere and every call is a no-op.
    """

    def __init__(self, output_dir: str | os.PathLike, enabled: bool = True, jsonl_name: str = "metrics.jsonl"):
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self.jsonl_path = self.output_dir / jsonl_name
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        for key, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(key, float(value), step)
        append_jsonl(self.jsonl_path, {"step": step, "time": time.time(), **scalars})

    def text(self, tag: str, text: str, step: int) -> None:
        if self.enabled:
            self.writer.add_text(tag, text, step)

    def flush(self) -> None:
        if self.enabled:
            self.writer.flush()

    def close(self) -> None:
        if self.enabled:
            self.writer.close()
