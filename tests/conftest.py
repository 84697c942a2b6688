"""Shared fixtures. Everything here works offline on 2 CPU cores."""
from __future__ import annotations

import os
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
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=256, vocab_size=len(gpt2_tokenizer),
                        bos_token_id=gpt2_tokenizer.eos_token_id, eos_token_id=gpt2_tokenizer.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(path)
    gpt2_tokenizer.save_pretrained(path)
    return path


def run_script(args: list[str], cwd: Path | None = None, timeout: float = 600, env: dict | None = None):
    """Run a repo script in a fresh interpreter; returns CompletedProcess with text output."""
    import subprocess

    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=cwd or REPO, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def kill_when_ready(args: list[str], ready: Path, timeout: float = 300) -> None:
    """Start a repo script and SIGKILL it, with every process it started (a launcher's workers), as soon as `ready`
    exists: a real crash, in the middle of the run."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + timeout
    while not ready.exists():
        assert proc.poll() is None and time.time() < deadline, f"the run ended before {ready.name} appeared"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_until_group_is_gone(proc.pid)


def wait_until_group_is_gone(group: int, timeout: float = 60) -> None:
    """A SIGKILLed launcher is reaped at once, but its workers die when the kernel next schedules them and only then
    release their locks: a resume started before that is refused as a concurrent run."""
    import time

    def alive() -> list[int]:
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == group and fields[0] != "Z":  # a zombie holds no files
                pids.append(int(stat.parent.name))
        return pids

    deadline = time.time() + timeout
    while alive():
        assert time.time() < deadline, f"processes {alive()} outlived SIGKILL by {timeout} s"
        time.sleep(0.05)


@pytest.fixture(scope="session")
def pydoc_cache_dir(tmp_path_factory):
    """builtin:pydoc built once for the session, reused by every LoRA run."""
    from llmlab.data.pydoc_qa import load_pydoc

    cache = tmp_path_factory.mktemp("lora_pydoc")
    load_pydoc(cache)
    return cache
