"""scripts/gpu_smoke.sh can only run on a GPU machine; here we check it is valid bash and that every flag it
passes exists, so it does not rot while the scripts evolve."""

from __future__ import annotations

import re
import subprocess

from tests.conftest import run_script

LAUNCHER_FLAGS = {"--config_file", "--num_processes", "--mixed_precision"}  # accelerate launch's own


def test_gpu_smoke_script_is_valid_bash(repo_root):
    result = subprocess.run(["bash", "-n", str(repo_root / "scripts" / "gpu_smoke.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


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
