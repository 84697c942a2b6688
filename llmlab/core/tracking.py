"""Experiment trackers: the ones users already use, through accelerate's tracker API, plus metrics.jsonl.

Trainers pass `make_trackers(cfg.report_to, output_dir)` to `Accelerator(log_with=...)` and log with
`accelerator.log(...)`, as the Hugging Face examples do. `--report_to` takes tensorboard (default), wandb, mlflow,
aim, comet_ml, all (every one installed) or none; a named tracker that is not installed is a one-line error
(accelerate would skip it silently). metrics.jsonl is always written: one line per log call, numbers only, the
record tests and tools read without a tracker. Sweep trials run outside accelerate and use `MetricsLogger`.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Optional

from accelerate.tracking import GeneralTracker, TensorBoardTracker, on_main_process

from llmlab.core.config import check_report_to
from llmlab.core.io import append_jsonl


def make_trackers(report_to: list[str], output_dir: str | os.PathLike) -> list:
    """`log_with` for Accelerator: TensorBoard in OUTPUT_DIR/tensorboard, the others by name, and metrics.jsonl."""
    trackers: list = [JsonlTracker(Path(output_dir) / "metrics.jsonl")]
    for name in check_report_to(report_to):
        trackers.append(TensorBoardRun("tensorboard", output_dir) if name == "tensorboard" else name)
    return trackers


def session_records(hparams: dict[str, Any]) -> tuple:
    """TensorBoard HParams records for one run: its session start (the hparams) and end. No experiment record:
    with several kinds of runs under one --logdir, TensorBoard then lists every run's hparams and takes the metrics
    from the runs' own scalars, instead of showing one kind's columns with empty metrics."""
    from torch.utils.tensorboard.summary import hparams as hparams_summary

    _, start, end = hparams_summary(tracker_config(hparams), {})
    return start, end


class TensorBoardRun(TensorBoardTracker):
    """accelerate's TensorBoard tracker, with the run's hparams recorded in the run itself, next to its scalars
    (accelerate writes them into a separate timestamped run that has no metrics)."""

    @on_main_process
    def store_init_configuration(self, values: dict):
        start, self._end = session_records(values)
        self.writer.file_writer.add_summary(start)
        self.writer.flush()

    @on_main_process
    def finish(self):
        if getattr(self, "_end", None) is not None:
            self.writer.file_writer.add_summary(self._end)
        super().finish()


def tracker_config(config: dict[str, Any]) -> dict[str, Any]:
    """A resolved config as tracker hparams: scalars as they are, anything else (lists, None) as text."""
    return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in config.items()}


class JsonlTracker(GeneralTracker):
    """metrics.jsonl: `{"step": N, "time": T, "train/loss": ...}` per log call (numbers only; text goes to the
    other trackers). Written with one write() per line, so a killed run leaves at most a torn last line."""

    name = "jsonl"
    requires_logging_directory = False

    def __init__(self, path: str | os.PathLike):
        super().__init__()
        self.path = Path(path)

    @property
    def tracker(self):
        return self.path

    def log(self, values: dict, step: Optional[int] = None, **kwargs) -> None:
        numbers = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numbers:
            append_jsonl(self.path, {"step": step, "time": time.time(), **numbers})


class MetricsLogger:
    """Sweep trials: `log({"train/loss": 2.3}, step)` writes TensorBoard scalars and one metrics.jsonl line."""

    def __init__(self, output_dir: str | os.PathLike):
        from torch.utils.tensorboard import SummaryWriter

        self.output_dir = Path(output_dir)
        self.jsonl_path = self.output_dir / "metrics.jsonl"
        self.writer = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            if value is not None and math.isfinite(float(value)):
                self.writer.add_scalar(key, float(value), step)
        append_jsonl(self.jsonl_path, {"step": step, "time": time.time(), **scalars})

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
