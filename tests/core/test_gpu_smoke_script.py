"""scripts/gpu_smoke.sh can only run on a GPU machine; here we check it is valid bash and that every flag it
passes exists, so it does not rot while the scripts evolve."""

from __future__ import annotations

import re
import subprocess

from tests.conftest import run_script

LAUNCHER_FLAGS = {"--config_file", "--num_processes", "--mixed_precision"}  # accelerate launch's own


def test_the_gpu_scripts_are_valid_bash(repo_root):
    for script in ("gpu_smoke.sh", "gpu_call.sh", "gpu_wheels.sh"):
        result = subprocess.run(["bash", "-n", str(repo_root / "scripts" / script)], capture_output=True, text=True)
        assert result.returncode == 0, script + result.stderr


def test_the_gpu_call_installs_only_what_it_carries(repo_root):
    """A lent GPU machine has no package registry: the call installs the carried wheels with --no-index, and every
    package gpu_wheels.sh carries is pinned, so the wheels are the versions CI tests."""
    call = (repo_root / "scripts" / "gpu_call.sh").read_text()
    installs = [line for line in call.splitlines() if "pip install" in line and not line.lstrip().startswith("#")]
    assert installs and all("--no-index" in line for line in installs), installs
    wheels = (repo_root / "scripts" / "gpu_wheels.sh").read_text()
    carried = re.search(r"CARRY=\(([^)]*)\)", wheels).group(1).split()
    norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
    lines = (repo_root / "constraints.txt").read_text().splitlines()
    pinned = {norm(line.split("==")[0]) for line in lines if "==" in line}
    assert {"transformers", "accelerate", "deepspeed", "bitsandbytes", "gensim"} <= set(carried)
    assert {norm(name) for name in carried} <= pinned


def test_gpu_smoke_script_uses_only_existing_flags(repo_root):
    text = (repo_root / "scripts" / "gpu_smoke.sh").read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    used = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_]+)", code))
    helps = [
        run_script([script, "--help"], timeout=120).stdout
        for script in ("train_pretrain.py", "train_lora.py", "sweep.py")
    ]
    helps += [
        run_script(["merge_and_infer.py", sub, "--help"], timeout=120).stdout for sub in ("merge", "generate", "bench")
    ]
    known = set(re.findall(r"(--[a-z][a-z0-9_]+)", "\n".join(helps))) | LAUNCHER_FLAGS
    assert used - known == set(), f"gpu_smoke.sh passes flags no script accepts: {sorted(used - known)}"
