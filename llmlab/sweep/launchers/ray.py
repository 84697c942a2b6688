"""Trials as Ray tasks: one sweep spread over the machines of a Ray cluster (`sweep.py --launcher ray`).

Each trial is one task with --cpus_per_trial / --gpus_per_trial that runs the very subprocess the local launcher
runs (`python -m llmlab.sweep.trial spec.json`), on whichever node Ray picks. Nothing assumes a shared filesystem:
llmlab's code travels as a runtime_env py_module, the token arrays reach each node once through the object store
(cached there under their hash), and the trial's folder comes back as bytes that the driver writes where the
local launcher would have. A node or worker lost mid-trial is a Ray system failure, so Ray runs the task again
elsewhere (--node_retries); only a finished task's files are written, result.json last, so a trial appears once.
"""

from __future__ import annotations

import hashlib
import json
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np
import ray
from filelock import FileLock

import llmlab
from llmlab.core.errors import UserError
from llmlab.core.io import atomic_write_bytes, atomic_write_json, llmlab_cache
from llmlab.sweep.launchers import (
    SPLITS,
    exit_result,
    fresh_trial_dir,
    log_tail,
    save_token_arrays,
    start_trial_process,
    wait_for_trial,
)
from llmlab.sweep.spec import TrialSpec

START_A_CLUSTER = (
    "start one with `ray start --head` on this machine (and `ray start --address HEAD_IP:6379` on "
    "the others), then pass --ray_address auto, or HEAD_IP:6379 from elsewhere"
)


def reachable(address: str, timeout: float = 5.0) -> Optional[str]:
    """Why HOST:PORT cannot be reached, or None: ray.init would retry an unreachable address for a minute."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return f"--ray_address {address} is not auto or HOST:PORT"
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as err:
        return f"no Ray cluster answers at {address} ({err.strerror or err})"
    return None


def connect(address: str) -> dict:
    """Join the cluster (once per process); its CPUs and GPUs. No cluster: one line naming the address."""
    if ray.is_initialized():
        return ray.cluster_resources()
    problem = None if address == "auto" else reachable(address)
    if problem:
        raise UserError(f"{problem}; {START_A_CLUSTER}")
    try:
        ray.init(
            address=address,
            runtime_env={"py_modules": [str(Path(llmlab.__file__).parent)]},
            log_to_driver=False,
            logging_level="ERROR",
            configure_logging=False,
        )
    except ConnectionError as err:
        raise UserError(
            f"no Ray cluster at --ray_address {address} ({str(err).split('. ')[0][:120]}); {START_A_CLUSTER}"
        ) from None
    return ray.cluster_resources()


def data_digest(data_dir: Path) -> str:
    digest = hashlib.sha256()
    for split in SPLITS:
        digest.update((data_dir / f"{split}.npy").read_bytes())
    return digest.hexdigest()[:16]


def node_data(key: str, boxed_ref: list) -> Path:
    """The token arrays on this node: cached under their hash, fetched from the object store only when missing.
    (The ref arrives boxed in a list so that Ray does not fetch it for every task.)"""
    folder = llmlab_cache("ray_data") / key
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):  # two tasks on one node fetch once
        if not all((folder / f"{split}.npy").is_file() for split in SPLITS):
            save_token_arrays(folder, ray.get(boxed_ref[0]), f"free space on {socket.gethostname()}")
    return folder


def run_on_node(spec: dict, key: str, boxed_ref: list) -> dict:
    """The Ray task: run one trial in a subprocess on this node, with the trial timeout, and return its folder."""
    node = f"{socket.gethostname()}/{ray.get_runtime_context().get_node_id()[:8]}"
    data_dir = node_data(key, boxed_ref)
    code_root = str(Path(llmlab.__file__).resolve().parent.parent)  # where Ray unpacked llmlab on this node
    with tempfile.TemporaryDirectory(prefix="llmlab-trial-") as tmp:
        trial_dir = Path(tmp)
        spec_path = trial_dir / "spec.json"
        spec_path.write_text(json.dumps({**spec, "trial_dir": tmp, "data_dir": str(data_dir), "driver": None}))
        # the trial dies with this worker (PR_SET_PDEATHSIG)
        proc = start_trial_process(spec_path, trial_dir / "log.txt", code_root, {"TOKENIZERS_PARALLELISM": "false"})
        code, timed_out = wait_for_trial(proc, spec["timeout_s"])
        files = {
            str(p.relative_to(trial_dir)): p.read_bytes()
            for p in sorted(trial_dir.rglob("*"))
            if p.is_file() and p != spec_path
        }
    return {"node": node, "files": files, "exit_code": code, "timed_out": timed_out}


class RayLauncher:
    """TrialLauncher's contract (run(spec, slot) -> result, kill_all, workers) over a Ray cluster."""

    def __init__(
        self, address: str, data_dir: Path, cpus_per_trial: float = 1, gpus_per_trial: float = 0, node_retries: int = 2
    ):
        resources = connect(address)
        cpus, gpus = resources.get("CPU", 0), resources.get("GPU", 0)
        fits = [cpus // cpus_per_trial] + ([gpus // gpus_per_trial] if gpus_per_trial else [])
        self.workers = int(min(fits))
        if self.workers < 1:
            raise UserError(
                f"the Ray cluster at {address} has {cpus:g} CPUs and {gpus:g} GPUs, too few for one trial "
                f"of --cpus_per_trial {cpus_per_trial:g} --gpus_per_trial {gpus_per_trial:g}"
            )
        nodes = sum(1 for node in ray.nodes() if node["Alive"])
        print(
            f"Ray cluster: {nodes} node(s), {cpus:g} CPUs, {gpus:g} GPUs -> up to {self.workers} trial(s) at once",
            flush=True,
        )
        self.threads = max(1, int(cpus_per_trial))
        self.key = data_digest(data_dir)
        self.data_ref = ray.put({split: np.load(data_dir / f"{split}.npy") for split in SPLITS})
        self.task = ray.remote(run_on_node).options(
            num_cpus=cpus_per_trial, num_gpus=gpus_per_trial, max_retries=node_retries, retry_exceptions=False
        )
        self.node_retries = node_retries
        self.active: dict[str, ray.ObjectRef] = {}
        self.lock = threading.Lock()
        self.stopping = False

    def run(self, spec: TrialSpec, slot: int) -> dict:
        spec, trial_dir = fresh_trial_dir(spec, threads=self.threads)
        started = time.time()
        ref = self.task.remote(spec.to_json(), self.key, [self.data_ref])
        with self.lock:
            self.active[spec.trial_id] = ref
        try:
            outcome = ray.get(ref)
        except ray.exceptions.RayError as err:
            if isinstance(err, ray.exceptions.RayTaskError):  # the task itself raised on its node (a full disk...)
                reason = f"the Ray task failed on its node: {str(err.cause).splitlines()[0][:200]}"
            else:  # a system failure Ray already retried --node_retries times
                reason = (
                    f"its Ray worker or node was lost {self.node_retries + 1} time(s) ({type(err).__name__}); "
                    "see `ray status`"
                )
            result = exit_result(spec, None, False, self.stopping, started, "", reason)
            atomic_write_json(trial_dir / "result.json", result)
            return result
        finally:
            with self.lock:
                self.active.pop(spec.trial_id, None)
        files = outcome["files"]
        for name, data in files.items():  # result.json last: it is what marks the trial finished
            if name != "result.json":
                atomic_write_bytes(trial_dir / name, data)
        if "result.json" in files:
            result = json.loads(files["result.json"])
        else:
            result = exit_result(
                spec,
                outcome["exit_code"],
                outcome["timed_out"],
                self.stopping,
                started,
                log_tail(trial_dir / "log.txt"),
            )
        result["node"] = outcome["node"]
        atomic_write_json(trial_dir / "result.json", result)
        return result

    def kill_all(self) -> None:
        with self.lock:
            self.stopping = True
            for ref in self.active.values():
                ray.cancel(ref, force=True)


def check_cluster(cfg) -> None:
    """No cluster at --ray_address: one line, before the sweep writes anything."""
    connect(cfg.ray_address)


def ray_launcher(cfg, out_dir, name: str) -> RayLauncher:
    return RayLauncher(cfg.ray_address, out_dir / "data", cfg.cpus_per_trial, cfg.gpus_per_trial, cfg.node_retries)
