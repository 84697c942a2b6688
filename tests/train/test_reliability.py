"""Issue 14: a run folder is owned, verified and never silently overwritten; no NaN model is ever published; every
user error is one line. The run a fault meets (kill -9, a concurrent owner, Ctrl-C, a damaged checkpoint, a spike,
a divergence) is a real process of its own; runs that only set the stage, and option refusals, run in the test's
process (tests.conftest.run_in_process: the same main, without ~5 CPU-seconds of imports each)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmlab.core.errors import UserError
from llmlab.core.io import read_jsonl
from tests.conftest import REPO, run_in_process, run_script, sweep_args
from tests.train.test_pretrain import SMALL, assert_one_line_error


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("reliability_data"))


def pretrain(out: Path, cache: str, *extra: str, steps: int = 8) -> list[str]:
    return [
        "train_pretrain.py",
        *SMALL,
        "--cache_dir",
        cache,
        "--output_dir",
        str(out),
        "--max_steps",
        str(steps),
        "--save_every",
        "4",
        "--keep_last",
        "2",
        "--eval_every",
        "4",
        *extra,
    ]


def start(args: list[str]) -> subprocess.Popen:
    # a run started from a shell without job control (`cmd &` in a script) inherits SIGINT ignored, and Python
    # then never raises KeyboardInterrupt: start each run as a terminal would, with Ctrl-C at its default
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def wait_for(path: Path, proc: subprocess.Popen | None = None, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc is None or proc.poll() is None, f"the run ended before {path.name} appeared"
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def steps_logged(out: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r]


# ------------------------------------------------------------------ ownership
@pytest.mark.slow
def test_a_fresh_run_never_lands_on_an_old_one(tmp_path, data_cache):
    out = tmp_path / "run"
    assert run_in_process(pretrain(out, data_cache, steps=4)).returncode == 0
    again = run_in_process(pretrain(out, data_cache, steps=4))
    assert_one_line_error(again, "already holds a pretraining", "--resume_from_checkpoint", "--overwrite_output_dir")
    (out / "notes.txt").write_text("mine")
    fresh = run_in_process(pretrain(out, data_cache, "--overwrite_output_dir", steps=4))
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert (out / "notes.txt").read_text() == "mine"  # only what a run writes is ever replaced
    assert steps_logged(out) == [1, 2, 3, 4] and sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_4"]


@pytest.mark.slow
def test_a_second_run_in_the_same_folder_is_refused_and_a_dead_owner_is_taken_over(tmp_path, data_cache):
    out = tmp_path / "run"
    first = start(pretrain(out, data_cache, steps=400))
    wait_for(out / "checkpoints" / "step_4", first)
    second = run_script(pretrain(out, data_cache, "--resume_from_checkpoint", "latest"))
    assert_one_line_error(second, "is in use by another pretraining", f"pid {first.pid}")
    first.send_signal(signal.SIGKILL)
    first.wait()
    latest = max(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))
    resumed = run_script(pretrain(out, data_cache, "--resume_from_checkpoint", "latest", steps=latest + 2))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"locked by pid {first.pid}" in resumed.stdout + resumed.stderr and "taking it over" in resumed.stdout


@pytest.mark.slow
def test_ctrl_c_is_one_line_naming_the_last_checkpoint(tmp_path, data_cache):
    out = tmp_path / "run"
    proc = start(pretrain(out, data_cache, steps=400))
    wait_for(out / "checkpoints" / "step_4", proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    errors = [line for line in stderr.splitlines() if line.startswith(("error:", "interrupted:"))]
    assert proc.returncode == 130 and len(errors) == 1 and "Traceback" not in stderr, stderr[-2000:]
    assert errors[0].startswith("interrupted: at step") and "checkpoints/step_" in errors[0]
    assert "--resume_from_checkpoint" in errors[0] and not (out / "final").exists()


@pytest.mark.slow
def test_ctrl_c_before_the_first_checkpoint_says_one_consistent_thing(tmp_path, data_cache):
    out = tmp_path / "run"
    proc = start(pretrain(out, data_cache, "--save_every", "1000", steps=400))
    wait_for(out / "metrics.jsonl", proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    said = [line for line in stderr.splitlines() if line.startswith(("error:", "interrupted:", "note:"))]
    assert proc.returncode == 130 and len(said) == 1, stderr[-2000:]
    assert "before the first checkpoint" in said[0] and "--overwrite_output_dir" in said[0]
    assert "resume_from_checkpoint" not in said[0]


# ------------------------------------------------------------------ checkpoints are verified
@pytest.mark.slow
def test_damaged_checkpoints_are_named_and_the_newest_good_one_is_used(tmp_path, data_cache):
    out = tmp_path / "run"
    assert run_in_process(pretrain(out, data_cache, steps=12)).returncode == 0
    weights = out / "checkpoints" / "step_12" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = b"\x7f" * 64  # same size, other bytes: only a checksum can tell
    weights.write_bytes(bytes(data))
    explicit = run_script(pretrain(out, data_cache, "--resume_from_checkpoint", str(weights.parent), steps=16))
    assert_one_line_error(explicit, "damaged", "model.safetensors", "sha256", "step_8")
    manifest = out / "checkpoints" / "step_8" / "trainer_state.json"
    state = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**state, "note": "an extra key is fine"}))
    resumed = run_script(pretrain(out, data_cache, "--resume_from_checkpoint", "latest", steps=16))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "step_12" in resumed.stdout and "resuming from step_8, the newest good checkpoint" in resumed.stdout
    assert list((out / "checkpoints").glob("step_12.abandoned-*"))  # set aside, not deleted
    manifest = out / "checkpoints" / "step_16" / "trainer_state.json"
    manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items() if k != "layout"}))
    missing = run_script(pretrain(out, data_cache, "--resume_from_checkpoint", str(manifest.parent), steps=20))
    assert_one_line_error(missing, "lacks 'layout'")


@pytest.mark.slow
def test_resume_honours_schedule_changes_and_refuses_the_rest(tmp_path, data_cache):
    import torch
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    out = tmp_path / "run"
    assert run_in_process(pretrain(out, data_cache, steps=8)).returncode == 0
    resumed = run_in_process(
        pretrain(out, data_cache, "--resume_from_checkpoint", "latest", "--learning_rate", "5e-3", steps=12)
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "honouring changed option(s) learning_rate, max_steps" in resumed.stdout
    schedule = get_cosine_with_min_lr_schedule_with_warmup(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=5e-3),
        num_warmup_steps=1,
        num_training_steps=12,
        min_lr_rate=1e-5 / 5e-3,
    ).lr_lambdas[0]
    lrs = {r["step"]: r["train/lr"] for r in read_jsonl(out / "metrics.jsonl") if "train/lr" in r}
    assert lrs[9] == pytest.approx(5e-3 * schedule(8)) and lrs[12] == pytest.approx(5e-3 * schedule(11))
    changed = run_in_process(
        pretrain(out, data_cache, "--resume_from_checkpoint", "latest", "--n_embd", "64", steps=16)
    )
    assert_one_line_error(changed, "--n_embd changed since checkpoint", "resume with the same --n_embd")


# ------------------------------------------------------------------ nothing non-finite is published
@pytest.mark.slow
def test_no_nan_model_is_ever_published(tmp_path, data_cache):
    assert_one_line_error(
        run_in_process(pretrain(tmp_path / "a", data_cache, "--learning_rate", "inf")), "--learning_rate", "finite"
    )
    assert_one_line_error(run_in_process(pretrain(tmp_path / "b", data_cache, "--clip", "nan")), "--clip")
    wild = run_script(
        pretrain(
            tmp_path / "c",
            data_cache,
            "--learning_rate",
            "1e30",
            "--min_lr",
            "0",
            "--spike_patience",
            "1",
            "--max_rollbacks",
            "1",
            steps=12,
        )
    )
    assert wild.returncode == 2 and "Traceback" not in wild.stderr, wild.stderr[-2000:]
    assert not (tmp_path / "c" / "final").exists()
    for manifest in (tmp_path / "c" / "checkpoints").glob("step_*/trainer_state.json"):  # every sealed one is finite
        from safetensors.torch import load_file

        weights = load_file(manifest.parent / "model.safetensors")
        assert all(bool(t.isfinite().all()) for t in weights.values())


# ------------------------------------------------------------------ spikes: early and drills
@pytest.mark.slow
def test_a_spike_in_the_first_steps_is_caught(tmp_path, data_cache):
    out = tmp_path / "run"
    proc = run_script(
        pretrain(out, data_cache, "--inject_spike", "26:10", "--spike_patience", "3", "--save_every", "5", steps=32)
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = read_jsonl(out / "events.jsonl")
    assert [e["event"] for e in events] == ["rollback"] and events[0]["resumed_step"] == 25
    blind = run_in_process(pretrain(tmp_path / "blind", data_cache, "--inject_spike", "12", "--save_every", "4"))
    assert_one_line_error(blind, "--inject_spike 12", "arms after 20 normal steps")
    early = run_in_process(pretrain(tmp_path / "early", data_cache, "--inject_spike", "3"))
    assert_one_line_error(early, "--inject_spike 3", "no checkpoint to roll back to")


# ------------------------------------------------------------------ one-line errors for bad paths and files
def test_an_output_folder_that_is_a_file_fails_before_any_setup(tmp_path, data_cache):
    target = tmp_path / "file"
    target.write_text("x")
    began = time.time()
    proc = run_script(pretrain(target, data_cache))
    assert_one_line_error(proc, "is a file, not a folder")
    assert time.time() - began < 60 and target.read_text() == "x"


def test_disk_full_while_checkpointing_is_one_line_and_leaves_no_partial_folder(tmp_path):
    from llmlab.train.checkpointing import save_checkpoint

    class FullDisk:
        is_main_process = True

        def wait_for_everyone(self):
            pass

        def save_state(self, folder):
            (Path(folder) / "model.safetensors").write_bytes(b"partial")
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                "data/0: file write failed (unexpected pos 1024 vs 512)"
            )

    with pytest.raises(UserError, match="the disk is full") as err:
        save_checkpoint(FullDisk(), tmp_path, 4, {}, keep_last=2)
    assert "\n" not in str(err.value) and not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_non_utf8_files_are_one_line_errors_naming_file_and_line(tmp_path, gpt2_tokenizer, tiny_gpt2_dir):
    from llmlab.data.instruct import load_records
    from llmlab.data.prepare import DataConfig, prepare_dataset

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(
        b'{"text": "fine line of text that is long enough to be kept by the filter"}\n{"text": "caf\xe9 latin-1"}\n'
    )
    with pytest.raises(UserError, match=r"corpus.jsonl:2 is not UTF-8 text \(byte 0xe9 at column 14\)"):
        prepare_dataset(DataConfig(dataset=str(corpus), block_size=16, cache_dir=str(tmp_path / "c")), gpt2_tokenizer)
    records = tmp_path / "records.jsonl"
    records.write_bytes(b'{"instruction": "a", "output": "b"}\n\xff\xfe\n')
    with pytest.raises(UserError, match="records.jsonl:2 is not UTF-8"):
        load_records(str(records))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "\xc3"}\n')
    proc = run_script(["merge_and_infer.py", "generate", "--model", str(tiny_gpt2_dir), "--prompts_file", str(prompts)])
    assert_one_line_error(proc, "prompts.jsonl:1 is not UTF-8")


def test_generate_output_that_is_a_folder_is_refused_before_generating(tiny_gpt2_dir, tmp_path):
    proc = run_script(
        ["merge_and_infer.py", "generate", "--model", str(tiny_gpt2_dir), "--prompt", "hi", "--output", str(tmp_path)]
    )
    assert_one_line_error(proc, "--output", "is a folder")


def test_a_damaged_tokenizer_cache_is_rebuilt_and_a_damaged_shard_refused(tmp_path, monkeypatch):
    from llmlab.data.prepare import DataConfig, prepare_dataset
    from llmlab.data.tokenizer import load_tokenizer

    monkeypatch.setenv("LLMLAB_CACHE", str(tmp_path / "cache"))
    tokenizer = load_tokenizer()
    vocab = tmp_path / "cache" / "gpt2-tokenizer" / "vocab.json"
    vocab.write_text(vocab.read_text()[:1000])  # truncated by a full disk or a killed copy
    tokenizer = load_tokenizer()
    assert len(tokenizer) == 50257 and tokenizer("Hello world")["input_ids"] == [15496, 995]
    cfg = DataConfig(block_size=32, max_documents=3, cache_dir=str(tmp_path / "data"))
    first = prepare_dataset(cfg, tokenizer)
    shard = next(first.cache_path.glob("train_*.bin"))
    shard.write_bytes(shard.read_bytes()[:100])  # token shards are named and refused, never silently rebuilt
    with pytest.raises(UserError, match=f"{shard.name} is 100 bytes.*truncated"):
        prepare_dataset(cfg, tokenizer)


# ------------------------------------------------------------------ merge never deletes what it did not write
def test_merge_never_deletes_a_folder_it_did_not_write(tmp_path, tiny_gpt2_dir):
    import shutil

    runs = tmp_path / "runs"
    base = runs / "pretrain" / "final"
    shutil.copytree(tiny_gpt2_dir, base)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    for out in (runs, tmp_path / "userfolder"):
        out.mkdir(exist_ok=True)
        proc = run_script(
            [
                "merge_and_infer.py",
                "merge",
                "--base_model",
                str(base),
                "--adapter",
                str(adapter),
                "--out",
                str(out),
                "--overwrite",
            ]
        )
        assert_one_line_error(proc)
        assert "contains the --base_model" in proc.stderr or "not a merged model" in proc.stderr
    assert (base / "model.safetensors").is_file() and (base / "config.json").is_file()


# ------------------------------------------------------------------ the sweep: owned folder, trials die with it
def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_killed_sweep_driver_takes_its_trials_with_it(tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text("trials:\n  - {optimizer: adamw}\n  - {optimizer: lion}\n")
    out, cache = tmp_path / "out", tmp_path / "cache"
    # a generous timeout: on a loaded machine the pre-check would otherwise fail both trials and the sweep would end
    driver = start(sweep_args(out, cache, "--workers", "2", "--steps", "400", "--trial_timeout", "3600", grid=grid))
    pids = []
    for trial in ("g01", "g02"):
        wait_for(out / "trials" / trial / "metrics.jsonl", driver)
        pids.append(int((out / "trials" / trial / "pid").read_text()))
    busy = run_script(sweep_args(out, cache, "--workers", "2", "--steps", "400", "--trial_timeout", "3600", grid=grid))
    assert_one_line_error(busy, "is in use by another sweep")
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    deadline = time.time() + 20
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "trial workers outlived their sweep driver"


@pytest.mark.slow
def test_damaged_sweep_files_rerun_or_explain(tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text("trials:\n  - {optimizer: adamw}\n  - {optimizer: lion}\n")
    out, cache = tmp_path / "out", tmp_path / "cache"
    assert run_script(sweep_args(out, cache, "--workers", "2", grid=grid)).returncode == 0
    result = out / "trials" / "g02" / "result.json"
    result.write_text(result.read_text()[:50])
    train = out / "data" / "train.npy"
    train.write_bytes(train.read_bytes()[:1000])
    rerun = run_script(sweep_args(out, cache, grid=grid))
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "g02/result.json is damaged" in rerun.stdout and "prepared data" in rerun.stdout
    assert "1 finished trial(s) skipped (g01); 1 to run" in rerun.stdout
    rows = {r["trial_id"]: r for r in map(json.loads, [p.read_text() for p in (out / "trials").glob("*/result.json")])}
    assert {r["status"] for r in rows.values()} == {"ok"}
    (out / "sweep.json").write_text("{")
    assert_one_line_error(run_script(sweep_args(out, cache, grid=grid)), "sweep.json is damaged")
    assert not math.isnan(rows["g02"]["final_loss"])


# ------------------------------------------------------------------ memory
def _prepare_peak_mb(dataset: Path, tmp_path: Path) -> float:
    """Peak RSS of `train_pretrain.py --prepare_only` on `dataset`, in a fresh process (Linux ru_maxrss: KiB)."""
    code = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            sys.executable,
            "train_pretrain.py",
            "--prepare_only",
            "--dataset",
            str(dataset),
            "--cache_dir",
            str(tmp_path / f"cache_{dataset.suffix[1:]}"),
            "--output_dir",
            str(tmp_path / f"out_{dataset.suffix[1:]}"),
            "--near_dup_threshold",
            "0",
            "--val_fraction",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.strip().splitlines()[-1]) / 1024


def test_a_huge_one_line_document_costs_no_more_memory_than_the_same_text_as_many(tmp_path):
    """Tokenising a document in one piece took ~150 bytes per character (a 50 MB line peaked at 7.6 GB); cut into
    pieces it costs about what the same text split into ordinary documents costs."""
    import random

    words = [w for w in (REPO / "README.md").read_text().split() if w.isalpha()]  # no markup for the cleaner
    text = " ".join(random.Random(0).choice(words) for _ in range(300_000))  # ~2 MB, one line
    (tmp_path / "one.txt").write_text(text)
    with open(tmp_path / "many.jsonl", "w") as f:
        for i in range(0, len(text), 10_000):
            f.write(json.dumps({"text": text[i : i + 10_000]}) + "\n")
    one, many = _prepare_peak_mb(tmp_path / "one.txt", tmp_path), _prepare_peak_mb(tmp_path / "many.jsonl", tmp_path)
    # unsplit, this line alone would add ~150 bytes/char x 2 MB = ~300 MB on top of the many-document peak
    assert one < many + 100, (one, many)
