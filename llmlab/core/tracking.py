"""Experiment trackers: the ones users already use, through accelerate's tracker API, plus metrics.jsonl.

Trainers pass `make_trackers(cfg.report_to, output_dir)` to `Accelerator(log_with=...)` and log with
`accelerator.log(...)`, as the Hugging Face examples do. `--report_to` takes tensorboard (default), wandb, mlflow,
aim, comet_ml, a tracker a plugin registered with accelerate's `register_tracker_class`, all (every one
installed) or none; a named tracker that is not installed is a one-line error
(accelerate would skip it silently). metrics.jsonl is always written: one line per log call, numbers only, the
record tests and tools read without a tracker. Sweep trials run outside an Accelerator and use `MetricsLogger`: the
same trackers, started the way `Accelerator.init_trackers` starts them.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Optional

from accelerate import PartialState
from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, TensorBoardTracker, on_main_process

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
    """A sweep trial's trackers: the trainers' `--report_to` names and metrics.jsonl, without an Accelerator (a trial
    is its own process), started as `Accelerator.init_trackers` starts them. `log({"train/loss": 2.3}, step)` sends
    every finite value to the trackers and every value to metrics.jsonl; `log_summary` the end-of-run metrics to
    the trackers only (metrics.jsonl holds per-step rows)."""

    def __init__(
        self,
        output_dir: str | os.PathLike,
        report_to: list[str] = ("tensorboard",),
        config: Optional[dict[str, Any]] = None,
        project: str = "llmlab-trial",
    ):
        PartialState(cpu=True)  # accelerate's trackers log through its logger, which refuses to run before a state
        self.output_dir = Path(output_dir)
        self.jsonl_path = self.output_dir / "metrics.jsonl"
        self.trackers: list[GeneralTracker] = []
        for item in make_trackers(list(report_to), self.output_dir):
            if isinstance(item, JsonlTracker):
                continue  # log() writes metrics.jsonl itself: every value, not only the finite numbers
            if not isinstance(item, GeneralTracker):
                kind = LOGGER_TYPE_TO_CLASS[item]
                item = kind(project, self.output_dir) if kind.requires_logging_directory else kind(project)
            item.main_process_only = False  # a trial is one process: every tracker it starts is its own
            item.start()
            if config is not None:
                item.store_init_configuration(tracker_config(config))
            self.trackers.append(item)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.log_summary(scalars, step)
        append_jsonl(self.jsonl_path, {"step": step, "time": time.time(), **scalars})

    def log_summary(self, scalars: dict[str, float], step: Optional[int] = None) -> None:
        finite = {k: float(v) for k, v in scalars.items() if v is not None and math.isfinite(float(v))}
        for tracker in self.trackers:
            tracker.log(finite, step=step)

    def flush(self) -> None:
        for tracker in self.trackers:
            if hasattr(tracker, "writer"):  # TensorBoard buffers its events; the others send as they go
                tracker.writer.flush()

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
