"""How a trial reaches a process: `local` (this machine: a fork server or fresh interpreters) or `ray` (any node of
a Ray cluster). Every launcher runs the same `llmlab.sweep.trial` on a TrialSpec and leaves the same trial folder
(spec.json, log.txt, tensorboard/, result.json) in the sweep; what they share is here, light (no torch, no ray)."""
from __future__ import annotations

import shutil
import signal
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Optional

from llmlab.core.io import atomic_write_json
from llmlab.sweep.spec import TrialSpec

SPLITS = ("train", "validation")  # the token arrays (data/<split>.npy) every trial memory-maps
LOG_TAIL_LINES = 30


def fresh_trial_dir(spec: TrialSpec, **launch: Any) -> tuple[TrialSpec, Path]:
    """Empty the trial's folder (a rerun must not mix curves with a killed attempt) and write its spec.json with
    what the launcher adds (threads, the driver to die with)."""
    trial_dir = Path(spec.trial_dir)
    shutil.rmtree(trial_dir, ignore_errors=True)
    trial_dir.mkdir(parents=True)
    spec = replace(spec, **launch)
    atomic_write_json(trial_dir / "spec.json", spec.to_json())
    return spec, trial_dir


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def exit_result(spec: TrialSpec, code: Optional[int], timed_out: bool, stopping: bool, started: float, tail: str,
                reason: Optional[str] = None) -> dict:
    """The result row of a trial whose process ended without writing one: timed out, interrupted or crashed."""
    if timed_out:
        status, reason = "timeout", f"killed after the {spec.timeout_s} s trial timeout"
    elif stopping:
        status, reason = "interrupted", "the sweep was interrupted; rerunning the command reruns this trial"
    else:
        status = "crashed"
        if reason is None:
            reason = (f"killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
                      else f"exited with code {code} without a result")
            if code == -signal.SIGKILL:
                reason += " (SIGKILL: killed by a user or the out-of-memory killer)"
    return {"trial_id": spec.trial_id, "hparams": asdict(spec.hparams), "model": spec.model, "steps": spec.steps,
            "status": status, "failures": [reason], "boundary": False, "attempts": 1, "exit_code": code,
            "log_tail": tail, "wall_time_s": round(time.time() - started, 3)}
