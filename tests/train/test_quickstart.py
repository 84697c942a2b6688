"""The first five minutes (issue 15): the README's quick start command, run as written, uses every core and prints
no third-party warnings; `accelerate launch` no longer pins a CPU run to one thread."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from llmlab.core.device import available_cores
from tests.conftest import REPO

TINY = ["--max_steps", "3", "--max_documents", "5", "--block_size", "32", "--eval_every", "3"]
NOISE = re.compile(r"warn|fail|deprecat|error|setting accelerator|kernels|traceback", re.IGNORECASE)


def readme_quick_start() -> list[str]:
    """The pretraining command of the README's quick start block, split into argv."""
    text = (REPO / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    command = next(
        part.strip() for line in block.splitlines() for part in line.split("&&") if "train_pretrain.py" in part
    )
    return command.split()


def run(argv: list[str], tmp_path, env_extra: dict | None = None):
    import os

    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), **(env_extra or {})}
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


def test_the_readme_quick_start_is_quiet_and_uses_every_core(tmp_path):
    command = readme_quick_start()
    assert command[0] in ("python", "python3") and command[1] == "train_pretrain.py", command
    out = tmp_path / "run"
    proc = run(
        [sys.executable, *command[1:], *TINY, "--output_dir", str(out), "--cache_dir", str(tmp_path / "c")], tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in (proc.stdout + proc.stderr).replace("\r", "\n").splitlines() if line.strip()]
    noisy = [line for line in lines if NOISE.search(line)]
    assert noisy == [], noisy  # nothing but progress, the model line, the samples and the result
    assert json.loads((out / "run_info.json").read_text())["hardware"]["torch_threads"] == available_cores()
    assert sum(line.startswith("sample: ") for line in lines) == 2


def test_accelerate_launch_no_longer_trains_on_one_core(tmp_path):
    out = tmp_path / "run"
    proc = run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "train_pretrain.py",
            *TINY,
            "--output_dir",
            str(out),
            "--cache_dir",
            str(tmp_path / "c"),
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    threads = json.loads((out / "run_info.json").read_text())["hardware"]["torch_threads"]
    assert threads == available_cores()
    if available_cores() > 1:
        assert "accelerate launch set OMP_NUM_THREADS=1; using" in proc.stdout


def test_sweep_trial_workers_start_quietly():
    """The sweep's fork server preloads the trial module; its imports (peft via transformers.optimization) must not
    print the optional-kernel notices into the sweep's terminal."""
    proc = subprocess.run(
        [sys.executable, "-c", "import llmlab.sweep.trial"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and not NOISE.search(proc.stderr), proc.stderr[-2000:]
