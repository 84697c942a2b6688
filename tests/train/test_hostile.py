"""Hostile use (issue 22): a folder holds one kind of run, a refused command changes nothing on disk, and a resume,
a merge and an evaluation check the identity of what they build on. The command that meets data or a base changed in
place, or a killed merge's leftovers, is a real process of its own; the runs that set the stage, and the refusals of
a misused folder, run in the test's process (tests.conftest.run_in_process)."""

from __future__ import annotations

import json
import os
import shutil
import stat

import pytest

from tests.conftest import run_in_process, run_script, tiny_pretrain_args
from tests.train.test_lora import TINY_RUN

SMALL = tiny_pretrain_args(sample_tokens=0)


def tree(folder) -> dict:
    """Every file under a folder with its size and mtime: what "changed nothing" is checked against."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def one_line(proc, *fragments):
    assert proc.returncode == 2, (proc.stdout[-1000:], proc.stderr[-2000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    out = root / "pretrain"
    proc = run_in_process(
        [
            "train_pretrain.py",
            *SMALL,
            "--max_steps",
            "4",
            "--save_every",
            "2",
            "--cache_dir",
            str(root / "cache"),
            "--output_dir",
            str(out),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root, out


@pytest.mark.slow
def test_a_lora_run_cannot_take_over_a_pretraining_folder(pretrained, tiny_gpt2_dir, pydoc_cache_dir):
    _, out = pretrained
    before = tree(out)
    proc = run_in_process(
        [
            "train_lora.py",
            "--base_model",
            str(tiny_gpt2_dir),
            "--cache_dir",
            str(pydoc_cache_dir),
            "--output_dir",
            str(out),
            "--overwrite_output_dir",
            *TINY_RUN,
            "--max_steps",
            "2",
        ]
    )
    one_line(proc, "holds a pretraining run", "a lora run cannot use it")
    assert tree(out) == before  # nothing deleted, renamed or rewritten: not even the lock record


@pytest.mark.slow
def test_a_refused_resume_moves_no_checkpoint(pretrained):
    root, out = pretrained
    before = tree(out)
    proc = run_in_process(
        [
            "train_pretrain.py",
            *SMALL,
            "--max_steps",
            "1",
            "--warmup_steps",
            "0",
            "--cache_dir",
            str(root / "cache"),
            "--output_dir",
            str(out),
            "--resume_from_checkpoint",
            str(out / "checkpoints" / "step_2"),
        ]
    )
    one_line(proc, "past the 1 steps")
    assert tree(out) == before and not list((out / "checkpoints").glob("*.abandoned-*"))


@pytest.mark.slow
def test_a_resume_refuses_data_whose_content_changed(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(f"word{i % 97} text{i % 13}" for i in range(6000)))
    out, cache = tmp_path / "run", tmp_path / "cache"
    args = [
        "train_pretrain.py",
        *SMALL,
        "--dataset",
        str(text),
        "--save_every",
        "2",
        "--cache_dir",
        str(cache),
        "--output_dir",
        str(out),
    ]
    assert run_in_process([*args, "--max_steps", "2"]).returncode == 0
    text.write_text(" ".join(f"other{i % 89} words{i % 7}" for i in range(6000)))
    proc = run_script([*args, "--max_steps", "4", "--resume_from_checkpoint", "latest"], timeout=600)
    one_line(proc, "the data or the base model changed in place", "data")


@pytest.mark.slow
def test_lora_resume_and_merge_check_the_base_weights(tiny_gpt2_dir, pydoc_cache_dir, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_gpt2_dir, base)
    out = tmp_path / "lora"
    args = [
        "train_lora.py",
        "--base_model",
        str(base),
        "--cache_dir",
        str(pydoc_cache_dir),
        "--output_dir",
        str(out),
        *TINY_RUN,
        "--save_every",
        "2",
    ]
    assert run_in_process([*args, "--max_steps", "3"]).returncode == 0
    assert list((out / "checkpoints").glob("step_*"))
    record = json.loads((out / "adapter" / "llmlab_base.json").read_text())
    assert record["digest"].startswith("sha256:")
    other = tmp_path / "other"  # same shape, other weights: what re-running pretraining into final/ produces
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.01)
    model.save_pretrained(other)
    shutil.copy(base / "tokenizer.json", other)
    merge = run_script(
        [
            "merge_and_infer.py",
            "merge",
            "--base_model",
            str(other),
            "--adapter",
            str(out / "adapter"),
            "--out",
            str(tmp_path / "merged"),
        ]
    )
    one_line(merge, "was trained on", "pass the base it was trained on")
    assert not (tmp_path / "merged").exists()
    model.save_pretrained(base)  # the base folder replaced in place, then a resume
    resumed = run_script([*args, "--max_steps", "6", "--resume_from_checkpoint", "latest"], timeout=300)
    one_line(resumed, "changed in place", "base_model")
    stacked = run_in_process(
        [
            "train_lora.py",
            "--base_model",
            str(out / "adapter"),
            "--cache_dir",
            str(pydoc_cache_dir),
            "--output_dir",
            str(tmp_path / "stacked"),
            *TINY_RUN,
            "--max_steps",
            "1",
        ]
    )
    one_line(stacked, "is a LoRA adapter folder")
    assert not (tmp_path / "stacked").exists()


@pytest.mark.slow
def test_merge_overwrite_keeps_the_users_files_and_cleans_its_own_leftovers(tiny_gpt2_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "adapter"
    get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir),
        LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM"),
    ).save_pretrained(adapter)
    out = tmp_path / "merged"
    merge = [
        "merge_and_infer.py",
        "merge",
        "--base_model",
        str(tiny_gpt2_dir),
        "--adapter",
        str(adapter),
        "--out",
        str(out),
        "--dtype",
        "fp32",
    ]
    assert run_in_process(merge).returncode == 0
    (out / "prompts.jsonl").write_text('{"prompt": "mine"}\n')
    (out / "generations.jsonl").write_text('{"text": "also mine"}\n')
    abandoned = tmp_path / ".merged.tmp999999-abcd"  # a merge killed before publishing (its pid is gone)
    abandoned.mkdir()
    assert run_script([*merge, "--overwrite"]).returncode == 0
    assert (out / "prompts.jsonl").read_text() == '{"prompt": "mine"}\n' and (out / "generations.jsonl").is_file()
    assert not abandoned.exists()
    report = json.loads((out / "merge_report.json").read_text())
    assert "prompts.jsonl" not in report["files"] and "config.json" in report["files"]
    for path in out.iterdir():  # readable by others, like any file the user's umask makes
        assert stat.S_IMODE(path.stat().st_mode) & 0o044 == 0o044 or os.umask(0o022) & 0o044, path
