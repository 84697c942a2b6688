"""The lab's process isolation: a trial dies with the sweep that started it (never an orphan writing results), and
ends without leaking torch.compile's worker semaphores."""

from __future__ import annotations

import ctypes
import multiprocessing.util
import os
import sys
import threading
import time

from llmlab.core.runfolder import process_start_time


def watch_driver(driver) -> None:
    """Die with the sweep driver. PR_SET_PDEATHSIG only watches the direct parent, and a fork-server child's parent
    is the fork server, which the children themselves keep alive; so poll the driver's identity once a second."""
    if not driver or driver[1] is None:
        return

    def watch() -> None:
        while process_start_time(driver[0]) == driver[1]:
            time.sleep(1.0)
        os.kill(os.getpid(), 9)

    threading.Thread(target=watch, name="driver-watch", daemon=True).start()


def die_with_parent() -> None:
    """Linux: SIGKILL this trial when its launcher dies, so a killed sweep leaves no orphan writing results."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def release_compile_workers() -> None:
    """torch.compile's worker pool holds semaphores that the os._exit below would leak (the resource tracker warns once
    per compiled trial when the sweep ends): shut the pool down and run the finalizers a normal exit would run."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is not None:
        async_compile.shutdown_compile_workers()
    multiprocessing.util._run_finalizers()  # what a normal exit runs: semaphores unregister from the tracker
