"""A full disk is one line and leaves nothing half-written (issue 22): real processes writing into a small tmpfs.
Needs permission to mount a tmpfs (root in a container, as on the CI machine); skipped cleanly without it."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.conftest import run_script, tiny_pretrain_args
from tests.train.test_lora import TINY_RUN

SMALL = tiny_pretrain_args(max_documents=3, sample_tokens=0)


@pytest.fixture()
def small_disk(tmp_path):
    """A 3 MB tmpfs: smaller than any model file these commands write."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()[:80]})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def assert_full_disk_line(proc) -> None:
    assert proc.returncode == 2, (proc.stdout[-800:], proc.stderr[-2000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "the disk is full" in errors[0], errors[0]


def leftovers(folder: Path) -> list[str]:
    return [
        p.name
        for p in folder.rglob("*")
        if ".tmp" in p.name or p.name.startswith(".final") or (p.suffix == ".npy" and p.name.startswith("."))
    ]


@pytest.mark.slow
def test_pretraining_into_a_full_disk(small_disk, tmp_path):
    out = small_disk / "run"
    proc = run_script(
        [
            "train_pretrain.py",
            *SMALL,
            "--max_steps",
            "2",
            "--save_every",
            "1",
            "--cache_dir",
            str(tmp_path / "cache"),
            "--output_dir",
            str(out),
        ],
        timeout=600,
    )
    assert_full_disk_line(proc)
    assert not (out / "final").exists() and leftovers(small_disk) == []


@pytest.mark.slow
def test_a_sweep_into_a_full_disk_leaves_no_temp_arrays(small_disk):
    grid = small_disk.parent / "grid.yaml"
    grid.write_text("trials:\n  - {trial_id: a}\n")
    (small_disk / "filler").write_bytes(os.urandom(3 * 2**20 - 160 * 1024))  # room for the design, not the tokens
    proc = run_script(
        [
            "sweep.py",
            "--grid",
            str(grid),
            "--budget",
            "smoke",
            "--max_documents",
            "40",
            "--output_dir",
            str(small_disk / "sweep"),
        ],
        timeout=600,
    )
    assert_full_disk_line(proc)
    assert leftovers(small_disk) == []


@pytest.mark.slow
def test_merge_and_generate_into_a_full_disk(small_disk, tiny_gpt2_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "adapter"
    get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir),
        LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM"),
    ).save_pretrained(adapter)
    merge = run_script(
        [
            "merge_and_infer.py",
            "merge",
            "--base_model",
            str(tiny_gpt2_dir),
            "--adapter",
            str(adapter),
            "--out",
            str(small_disk / "merged"),
            "--dtype",
            "fp32",
        ]
    )
    assert_full_disk_line(merge)
    assert not (small_disk / "merged").exists() and leftovers(small_disk) == []
    (small_disk / "filler").write_bytes(os.urandom(3 * 2**20 - 12 * 1024))  # leave less than the results need
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {i}:"}) + "\n" for i in range(40)))
    generate = run_script(
        [
            "merge_and_infer.py",
            "generate",
            "--model",
            str(tiny_gpt2_dir),
            "--prompts_file",
            str(prompts),
            "--max_new_tokens",
            "64",
            "--output",
            str(small_disk / "out.jsonl"),
        ]
    )
    assert generate.returncode == 2 and "printed above as JSONL instead" in generate.stderr, generate.stderr[-1500:]
    printed = [json.loads(line) for line in generate.stdout.splitlines() if line.startswith("{")]
    assert len(printed) == 40 and not (small_disk / "out.jsonl").exists()


@pytest.mark.slow
def test_lora_into_a_full_disk(small_disk, tiny_gpt2_dir, pydoc_cache_dir):
    (small_disk / "filler").write_bytes(os.urandom(3 * 2**20 - 8 * 1024))
    proc = run_script(
        [
            "train_lora.py",
            "--base_model",
            str(tiny_gpt2_dir),
            "--cache_dir",
            str(pydoc_cache_dir),
            "--output_dir",
            str(small_disk / "lora"),
            *TINY_RUN,
            "--max_steps",
            "2",
        ],
        timeout=600,
    )
    assert_full_disk_line(proc)
    assert leftovers(small_disk) == []


@pytest.mark.slow
def test_preparing_data_into_a_full_disk_leaves_no_shard_a_later_run_accepts(small_disk, tmp_path):
    (small_disk / "filler").write_bytes(os.urandom(3 * 2**20 - 200 * 1024))  # ~200 KB free: less than the tokens
    args = [
        "train_pretrain.py",
        "--prepare_only",
        "--max_documents",
        "30",
        "--block_size",
        "32",
        "--shard_tokens",
        "20000",
        "--num_proc",
        "2",
    ]
    proc = run_script([*args, "--cache_dir", str(small_disk / "cache")], timeout=600)
    assert_full_disk_line(proc)
    assert leftovers(small_disk) == [] and not list(small_disk.rglob("manifest.json"))
    (small_disk / "filler").unlink()  # space again: the next run resumes and equals a preparation that never failed
    again = run_script([*args, "--cache_dir", str(small_disk / "cache")], timeout=600)
    fresh = run_script([*args, "--cache_dir", str(tmp_path / "fresh")], timeout=600)
    assert again.returncode == 0 and fresh.returncode == 0, again.stderr[-2000:]
    [resumed] = [p for p in (small_disk / "cache").iterdir() if p.is_dir()]
    [clean] = [p for p in (tmp_path / "fresh").iterdir() if p.is_dir()]
    names = sorted(p.name for p in clean.glob("*.bin"))
    assert names and names == sorted(p.name for p in resumed.glob("*.bin"))
    assert all((resumed / n).read_bytes() == (clean / n).read_bytes() for n in names)
