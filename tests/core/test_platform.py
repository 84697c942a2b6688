"""What runs where (issue 22): every script imports without the Unix-only `fcntl` and `resource` (as on Windows),
and an unsupported device is a one-line refusal."""

import subprocess
import sys

import pytest

from tests.conftest import REPO, run_script

BLOCK = r'''
import importlib, os, sys
REPO = os.getcwd()
class Blocker:
    """fcntl and resource are missing for llmlab's own imports, as on Windows (third-party packages choose their
    platform modules themselves: psutil's Linux backend needs resource, its Windows one does not)."""
    def find_spec(self, name, path=None, target=None):
        if name not in ("fcntl", "resource"):
            return None
        frame = sys._getframe(1)
        while frame is not None:
            filename = frame.f_code.co_filename
            if filename.startswith(REPO) and "site-packages" not in filename:
                raise ImportError(f"No module named {name!r}")
            if "site-packages" in filename:
                return None
            frame = frame.f_back
        return None
sys.meta_path.insert(0, Blocker())
for name in ("train_pretrain", "train_lora", "sweep", "merge_and_infer", "llmlab.sweep.trial", "llmlab.sweep.runner",
             "llmlab.train.pretrain.loop", "llmlab.train.lora.loop", "llmlab.infer.merge", "llmlab.core.runfolder"):
    importlib.import_module(name)
from llmlab.core.device import peak_rss_mb
assert peak_rss_mb() > 10
print("imported")
'''


def test_every_script_imports_without_fcntl_and_resource():
    proc = subprocess.run([sys.executable, "-c", BLOCK], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-3000:]
    import re

    unix_only = re.compile(r"^\s*import (fcntl|resource)\b", re.M)
    assert [p for p in (REPO / "llmlab").rglob("*.py") if unix_only.search(p.read_text())] == []


@pytest.mark.parametrize(
    "args",
    [
        ["sweep.py", "--device", "mps"],
        ["merge_and_infer.py", "generate", "--model", "x", "--prompt", "x", "--device", "mps"],
    ],
)
def test_mps_is_a_one_line_refusal(args):
    proc = run_script(args, timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "mps" in proc.stderr, proc.stderr
