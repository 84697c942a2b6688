"""Trials on this machine: `forkserver` (default on CPU) forks each trial from a server that imported
torch/transformers once, so a trial starts in a fraction of a second yet still gets its own process and CUDA
context; `spawn` runs `python -m llmlab.sweep.trial spec.json` from scratch (the default with CUDA, where a process
forked from a server that may have touched the CUDA driver is not safe). bench/sweep_overhead.py compares them.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import threading
import time
from multiprocessing import forkserver
from pathlib import Path
from typing import Any, Optional

import torch

from llmlab.core.io import atomic_write_json, atomic_write_text
from llmlab.core.runfolder import process_start_time
from llmlab.sweep.launchers import exit_result, fresh_trial_dir, log_tail, start_trial_process, wait_for_trial
from llmlab.sweep.spec import TrialSpec
from llmlab.sweep.trial import child_main

REPO_ROOT = Path(__file__).resolve().parents[3]
_FORKSERVER = None
# What every trial imports lazily (AdamW's constructor imports torch._dynamo, which imports sympy; the tracker imports
# tensorboard; a GPT-2 probe, transformers' GPT-2, 1.9 s of each trial's start here): imported once in the server, so
# no forked trial imports them itself (bench/sweep_overhead.py). Imports only: a trial's numbers are unchanged.
FORKSERVER_PRELOAD = [
    "llmlab.sweep.trial",
    "torch._dynamo",
    "torch.utils.tensorboard",
    "transformers.models.gpt2.modeling_gpt2",
]


def forkserver_context():
    """Start the fork server now: it imports torch/transformers while the parent prepares the data."""
    global _FORKSERVER
    if _FORKSERVER is None:
        _FORKSERVER = multiprocessing.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(FORKSERVER_PRELOAD)
        forkserver.ensure_running()
    return _FORKSERVER


def worker_env(slot: int, device: str) -> dict[str, str]:
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = str(slot % max(1, torch.cuda.device_count()))
    return env


class TrialLauncher:
    """Starts trials in their own processes on this machine, enforces the timeout, and records crashes."""

    def __init__(self, launcher: str = "forkserver", workers: int = 1, threads: int = 0):
        self.launcher, self.workers = launcher, workers
        self.threads = threads or max(1, (os.cpu_count() or 1) // workers)  # CPU threads per trial
        self.active: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.stopping = False

    def run(self, spec: TrialSpec, slot: int) -> dict:
        # the trial watches its driver: a trial forked from the fork server outlives a killed driver otherwise
        spec, trial_dir = fresh_trial_dir(
            spec, threads=self.threads, driver=[os.getpid(), process_start_time(os.getpid())]
        )
        spec_path = trial_dir / "spec.json"
        log_path = trial_dir / "log.txt"
        env = worker_env(slot, spec.device)
        started = time.time()
        if self.launcher == "spawn":
            proc = start_trial_process(spec_path, log_path, str(REPO_ROOT), env)
        else:
            proc = forkserver_context().Process(
                target=_child, args=(str(spec_path), str(log_path), env), name=f"trial-{spec.trial_id}"
            )
            proc.start()
        atomic_write_text(trial_dir / "pid_start", f"{process_start_time(proc.pid)}\n")  # with the pid, an identity
        atomic_write_text(trial_dir / "pid", f"{proc.pid}\n")
        with self.lock:
            self.active[spec.trial_id] = proc
        code, timed_out = self._wait(proc, spec.timeout_s)
        with self.lock:
            self.active.pop(spec.trial_id, None)
        (trial_dir / "pid").unlink(missing_ok=True)
        (trial_dir / "pid_start").unlink(missing_ok=True)
        result_path = trial_dir / "result.json"
        if result_path.is_file():
            return json.loads(result_path.read_text())
        result = exit_result(spec, code, timed_out, self.stopping, started, log_tail(log_path))
        atomic_write_json(result_path, result)
        return result

    def _wait(self, proc, timeout: float) -> tuple[Optional[int], bool]:
        if isinstance(proc, subprocess.Popen):
            return wait_for_trial(proc, timeout)
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            return proc.exitcode, True
        return proc.exitcode, False

    def kill_all(self) -> None:
        with self.lock:
            self.stopping = True
            for proc in self.active.values():
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _child(spec_path: str, log_path: str, env: dict) -> None:
    child_main(spec_path, log_path, env)


def local_launcher(cfg, out_dir, name: str) -> TrialLauncher:
    """--launcher forkserver / spawn: trials in processes on this machine."""
    return TrialLauncher(name, cfg.workers, cfg.threads_per_worker)
