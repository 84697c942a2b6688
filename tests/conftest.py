"""Shared fixtures. Everything here works offline on 2 CPU cores."""

from __future__ import annotations

import functools
import json
import math
import os
import socket
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Tests never touch the network; a hub lookup must fail fast instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two xdist workers share two cores and every test trains a tiny model, where a second thread per process only
# spins against the other worker's: one thread each, here and in every process a test starts (tests that check the
# thread defaults remove it from their processes' environment).
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:
    sys.modules["torch"].set_num_threads(1)


ZERO_OFFLOAD_TESTS = "tests/train/test_pretrain_deepspeed.py::test_zero2_"
_PREBUILD: list = []


def pytest_collection_finish(session):
    """DeepSpeed JIT-compiles its CPU Adam the first time a ZeRO-offload run starts: about 100 s of C++ on these
    cores, inside the first ZeRO test. The suite leaves about a quarter of two cores idle (its tests wait on
    processes, sockets and timeouts; a third worker measured no gain, docs/usage.md), so when the ZeRO tests are
    selected, the first worker starts the build as soon as it has collected, at the lowest priority, and it uses
    that idle time. A ZeRO test that starts before the build ends waits on torch's build lock, as a second run
    would."""
    worker = getattr(session.config, "workerinput", {}).get("workerid", "gw0")
    if worker != "gw0" or session.config.option.collectonly:
        return
    if not any(item.nodeid.startswith(ZERO_OFFLOAD_TESTS) for item in session.items):
        return
    import importlib.util
    import subprocess

    if importlib.util.find_spec("deepspeed") is None:
        return
    build = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
    # its own session: Ctrl-C on the suite lets it finish (a build killed halfway leaves torch's lock behind, and the
    # next ZeRO run would wait on it for ever); `nice`, not a preexec_fn, which is unsafe in a worker with threads
    _PREBUILD.append(
        subprocess.Popen(
            ["nice", "-n", "19", sys.executable, "-c", build],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    )


# Each file's seconds in a quiet run of the whole suite (pytest --durations=0, summed per file). With
# `--dist loadfile` each worker takes the next file in collection order, and that order was alphabetical, which
# put train/'s long files (test_reliability alone ~230 s) at the end, where one worker can be left running the
# last of them alone. Longest first (LPT) leaves only short files for the end; measured, the gain was within the
# host's drift (1,039 s -> 1,006 s, one clean-clone run each). A file not listed goes first: its cost is unknown.
# Stale numbers change only the order, never what runs.
FILE_SECONDS = Path(__file__).with_name("file_seconds.json")


def pytest_collection_modifyitems(session, config, items):
    seconds = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.is_file() else {}
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], math.inf))  # stable: in-file order kept


def pytest_sessionfinish(session):
    for proc in _PREBUILD:  # the ZeRO tests waited for it; a run stopped early waits here, never kills it
        proc.wait()


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """The smoke budget's sweep data, prepared once per test process for every sweep a test runs."""
    return tmp_path_factory.mktemp("sweep_data_cache")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def gpt2_tokenizer():
    from llmlab.data.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory, gpt2_tokenizer) -> Path:
    """A randomly initialised 2-layer GPT-2 (real vocab) saved with save_pretrained + tokenizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_gpt2")
    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        n_positions=256,
        vocab_size=len(gpt2_tokenizer),
        bos_token_id=gpt2_tokenizer.eos_token_id,
        eos_token_id=gpt2_tokenizer.eos_token_id,
    )
    GPT2LMHeadModel(config).save_pretrained(path)
    gpt2_tokenizer.save_pretrained(path)
    return path


def load_script(path: str):
    """A repo script that is not a package module (bench/*.py, scripts/*.py) imported as a module, to call one of
    its functions in-process: `load_script("scripts/findings.py")`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(path).stem, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_loaded_script = functools.cache(load_script)  # one module per script for the worker's in-process runs


def tiny_pretrain_args(**options) -> list[str]:
    """train_pretrain.py's options for a 1-layer, 32-wide GPT-2 with the real vocabulary on a few documents of the
    built-in Wikipedia sample, the smallest run that exercises every piece; keyword arguments override or add
    options (`learning_rate="1e-2"` is `--learning_rate 1e-2`)."""
    options = {
        "n_layer": 1,
        "n_embd": 32,
        "n_head": 2,
        "block_size": 32,
        "batch_size": 2,
        "effective_batch_size": 2,
        "max_documents": 5,
        "eval_batches": 2,
        "log_every": 1,  # a curve point per step: the tests compare runs step by step
        **options,
    }
    return [arg for name, value in options.items() for arg in (f"--{name}", str(value))]


def sweep_args(out, cache, *extra: str, grid=None) -> list[str]:
    """sweep.py at the smoke budget into `out`, its data cache in `cache`, a YAML `grid` if given. One CPU thread per
    trial: on a shared 2-core box, 2 threads per tiny trial measured ~8x slower."""
    return [
        "sweep.py",
        "--budget",
        "smoke",
        "--output_dir",
        str(out),
        "--data_cache_dir",
        str(cache),
        "--threads_per_worker",
        "1",
        *(["--grid", str(grid)] if grid is not None else []),
        *extra,
    ]


def tiny_trial(tmp: Path, trial_id: str, **levels):
    """One lab trial to run in-process with train_attempt: the control's levels with `levels` on top (batch 4), two
    steps of 16-token blocks logged every step, one eval batch, and random tokens (64 training rows, 8 validation).
    Returns (hparams, spec, data); `dataclasses.replace` the spec for more steps."""
    import numpy as np

    from llmlab.core.config import parse_config
    from llmlab.sweep.config import SweepConfig
    from llmlab.sweep.factors import CONTROL, resolve
    from llmlab.sweep.spec import Hparams, TrialSpec

    rng = np.random.default_rng(0)
    data = {
        "train": rng.integers(0, 50257, (64, 16)).astype(np.uint16),
        "validation": rng.integers(0, 50257, (8, 16)).astype(np.uint16),
    }
    hp = Hparams(**resolve(parse_config(SweepConfig, []), {**CONTROL, "batch_size": 4, **levels}))
    spec = TrialSpec(
        trial_id=trial_id,
        trial_dir=str(tmp),
        data_dir=str(tmp),
        hparams=hp,
        seed=42,
        steps=2,
        block_size=16,
        log_every=1,
        precheck_steps=2,
        timeout_s=600,
        eval_batches=1,
        eval_batch_size=4,
    )
    return hp, spec, data


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (for a launch's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(args: list[str], cwd: Path | None = None, timeout: float = 600, env: dict | None = None):
    """Run a repo script in a fresh interpreter; returns CompletedProcess with text output."""
    import subprocess

    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout, env=full_env
    )


def run_in_process(args: list[str], env: dict | None = None):
    """`run_script` without a fresh interpreter, for a run whose process is not what the test is about: the script's
    main(argv) in this worker, its exit status, stdout and stderr returned as a CompletedProcess. A tiny run in a
    new interpreter spends about 5 of its ~8 CPU-seconds importing torch and transformers (`python -X importtime`);
    here they are already loaded. What a run changes of the process is put back: accelerate's
    singletons, torch's thread count, signal handlers and the environment."""
    import contextlib
    import io
    import signal
    import subprocess
    import traceback

    import torch
    from accelerate.state import AcceleratorState, GradientState

    script = _loaded_script(args[0])
    out, err = io.StringIO(), io.StringIO()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    threads, saved_env = torch.get_num_threads(), dict(os.environ)
    os.environ.update(env or {})
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                script.main([str(a) for a in args[1:]])
            except SystemExit as done:
                code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
            except Exception:  # what a crashed interpreter would print, and its exit status
                traceback.print_exc()
                code = 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        AcceleratorState._reset_state(True)  # and PartialState
        GradientState._reset_state()
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def kill_when_ready(args: list[str], ready: Path, timeout: float = 300) -> None:
    """Start a repo script and SIGKILL it, with every process it started, as soon as `ready` exists: a real crash,
    in the middle of the run. A launcher's workers may sit in sessions of their own (torchrun starts them so), so
    the whole process tree is killed, and waited for: a worker still dying holds the run folder's lock."""
    import subprocess
    import time

    import psutil

    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + timeout
    while not ready.exists():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {ready.name} appeared"
        if time.time() > deadline:
            os.killpg(proc.pid, 9)  # its own session: the launcher and its workers
            raise AssertionError(f"{ready.name} did not appear within {timeout:.0f} s")
        time.sleep(0.05)
    root = psutil.Process(proc.pid)
    tree = [root, *root.children(recursive=True)]
    for member in tree:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()

    def running(member) -> bool:  # a zombie holds no files
        try:
            return member.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.time() + 60
    while any(running(member) for member in tree):
        assert time.time() < deadline, f"processes {[m.pid for m in tree if running(m)]} outlived SIGKILL by 60 s"
        time.sleep(0.05)


@pytest.fixture(scope="session")
def pretrain_cache(tmp_path_factory) -> Path:
    """One data cache for the session's tiny pretraining runs that do not test the cache itself: a fresh cache costs
    each run its preparation (about 3 s of a 8 s run). Per xdist worker, so no two test processes share it."""
    return tmp_path_factory.mktemp("pretrain_cache")


@pytest.fixture(scope="session")
def pydoc_cache_dir(tmp_path_factory):
    """builtin:pydoc built once for the session, reused by every LoRA run."""
    from llmlab.data.pydoc_qa import load_pydoc

    cache = tmp_path_factory.mktemp("lora_pydoc")
    load_pydoc(cache)
    return cache
