"""How a trial reaches a process: `local` (this machine: a fork server or fresh interpreters) or `ray` (any node of
a Ray cluster). Every launcher runs the same `llmlab.sweep.trial` on a TrialSpec and leaves the same trial folder
(spec.json, log.txt, tensorboard/, result.json) in the sweep; what they share is here, light (no torch, no ray).

Launchers are a registry, as optimizers are: a new one is a class (`workers`, `run(spec, slot) -> result`,
`kill_all()`) and one `register_launcher` call naming its factory; `--launcher NAME` then selects it."""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

import numpy as np

from llmlab.core.errors import writing
from llmlab.core.io import atomic_write_json
from llmlab.sweep.spec import SPLITS, TrialSpec  # noqa: F401 (SPLITS: part of this module's API)

LOG_TAIL_LINES = 30


@dataclass(frozen=True)
class LauncherEntry:
    """A registered way to give each trial its process. Targets are "module:function", imported only when used."""

    factory: str  # factory(cfg, out_dir, name) -> the launcher, built once the sweep's data is prepared
    remote: bool = False  # trials run on other machines: their device and precision are not the driver's to pick
    check: Optional[str] = None  # check(cfg): before anything is written (e.g. that the cluster answers)
    warm: Optional[str] = None  # warm(): before the data is prepared, to overlap a slow start with it
    help: str = ""


LAUNCHERS: dict[str, LauncherEntry] = {}


class LauncherChoices:
    """--launcher's choices, read when a config is parsed: auto and every registered launcher (plugins' too)."""

    def __iter__(self):
        return iter(("auto", *LAUNCHERS))


def register_launcher(name: str, entry: LauncherEntry) -> None:
    LAUNCHERS[name] = entry


def load_target(target: str):
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


register_launcher(
    "forkserver",
    LauncherEntry(
        "llmlab.sweep.launchers.local:local_launcher",
        warm="llmlab.sweep.launchers.local:forkserver_context",
        help="fork trials from a server that imported torch once (fast; the CPU default)",
    ),
)
register_launcher(
    "spawn",
    LauncherEntry(
        "llmlab.sweep.launchers.local:local_launcher",
        help="a fresh `python -m llmlab.sweep.trial` per trial (the CUDA default)",
    ),
)
register_launcher(
    "ray",
    LauncherEntry(
        "llmlab.sweep.launchers.ray:ray_launcher",
        remote=True,
        check="llmlab.sweep.launchers.ray:check_cluster",
        help="each trial a task on a Ray cluster's nodes (--ray_address)",
    ),
)


def save_token_arrays(folder: Path, arrays: dict, fix: str) -> None:
    """Write data/<split>.npy whole or not at all: a temp file renamed into place, removed if the write fails (a full
    disk is one line naming `fix`)."""
    folder.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        tmp = folder / f".{split}.{os.getpid()}.npy"
        try:
            with writing(f"the sweep's {split} tokens into {folder}", fix):
                np.save(tmp, arrays[split])
            os.replace(tmp, folder / f"{split}.npy")
        finally:
            tmp.unlink(missing_ok=True)


def start_trial_process(spec_path: Path, log_path: Path, code_root: str, env: dict) -> subprocess.Popen:
    """`python -m llmlab.sweep.trial spec.json` with llmlab from `code_root`, in a session of its own (so a timeout
    kills all of it), logging to `log_path`."""
    full_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([code_root, os.environ.get("PYTHONPATH", "")])}
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "llmlab.sweep.trial", str(spec_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=code_root,
            start_new_session=True,
        )


def wait_for_trial(proc: subprocess.Popen, timeout: float) -> tuple[int, bool]:
    """The trial's exit code, and whether it was killed at the timeout."""
    try:
        return proc.wait(timeout=timeout), False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(), True


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


def exit_result(
    spec: TrialSpec,
    code: Optional[int],
    timed_out: bool,
    stopping: bool,
    started: float,
    tail: str,
    reason: Optional[str] = None,
) -> dict:
    """The result row of a trial whose process ended without writing one: timed out, interrupted or crashed."""
    if timed_out:
        status, reason = "timeout", f"killed after the {spec.timeout_s} s trial timeout"
    elif stopping:
        status, reason = "interrupted", "the sweep was interrupted; rerunning the command reruns this trial"
    else:
        status = "crashed"
        if reason is None:
            reason = (
                f"killed by signal {signal.Signals(-code).name}"
                if code is not None and code < 0
                else f"exited with code {code} without a result"
            )
            if code == -signal.SIGKILL:
                reason += " (SIGKILL: killed by a user or the out-of-memory killer)"
    return {
        "trial_id": spec.trial_id,
        "hparams": asdict(spec.hparams),
        "model": spec.model,
        "steps": spec.steps,
        "status": status,
        "failures": [reason],
        "boundary": False,
        "attempts": 1,
        "exit_code": code,
        "log_tail": tail,
        "wall_time_s": round(time.time() - started, 3),
    }
