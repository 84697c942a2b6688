"""train_pretrain.py on real (small) data: learning, exact resume after SIGKILL, retention, rollback, errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from llmlab.core.errors import UserError
from llmlab.core.io import read_jsonl
from tests.conftest import kill_when_ready, run_in_process, run_script, tiny_pretrain_args

# A 1-layer, 32-wide GPT-2 with the real vocabulary, on 5 documents of the built-in Wikipedia sample.
SMALL = tiny_pretrain_args(effective_batch_size=4, learning_rate="1e-2", dropout=0.1)
STEPS = 24


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("pretrain_data"))


def train_args(out: Path, cache: str, *extra: str) -> list[str]:
    return [
        "train_pretrain.py",
        *SMALL,
        "--cache_dir",
        cache,
        "--output_dir",
        str(out),
        "--max_steps",
        str(STEPS),
        "--save_every",
        "4",
        "--keep_last",
        "2",
        "--eval_every",
        "8",
        *extra,
    ]


def last_by_step(out: Path, key: str) -> dict[int, float]:
    """The last logged value per step (a resumed run logs the steps after its checkpoint again)."""
    values = {}
    for rec in read_jsonl(out / "metrics.jsonl"):
        if key in rec:
            values[rec["step"]] = rec[key]
    return values


def assert_one_line_error(proc, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, proc.stderr[-2000:]
    for fragment in fragments:
        assert fragment in error_lines[0], error_lines[0]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, data_cache) -> Path:
    out = tmp_path_factory.mktemp("reference")
    proc = run_script(train_args(out, data_cache), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out / "stderr.txt").write_text(proc.stderr)
    return out


def test_loss_falls_and_outputs_are_usable(reference_run):
    bar = (reference_run / "stderr.txt").read_text()
    # a pipe gets a line a minute, not a frame per step (tqdm writes no carriage return there: count the frames)
    assert bar.count("\r") <= 3 and bar.count("pretrain:") <= 3, bar[-500:]
    losses = last_by_step(reference_run, "train/loss")
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = [losses[s] for s in (1, 2, 3)], [losses[s] for s in (STEPS - 2, STEPS - 1, STEPS)]
    assert sum(last) / 3 < sum(first) / 3 - 1.0, losses
    val = last_by_step(reference_run, "val/loss")
    assert sorted(val) == [8, 16, 24] and val[24] < val[8]
    assert math.isclose(last_by_step(reference_run, "val/perplexity")[24], math.exp(val[24]), rel_tol=1e-6)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    events = EventAccumulator(str(reference_run / "tensorboard"))
    events.Reload()
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "val/loss", "val/perplexity"):
        assert tag in events.Tags()["scalars"], tag
    mfu = [e.value for e in events.Scalars("train/mfu")]  # on CPU against the measured matmul peak
    assert mfu and all(0 < value < 1 for value in mfu)
    model = AutoModelForCausalLM.from_pretrained(reference_run / "final")
    assert model.config.n_layer == 1 and model.config.vocab_size == 50257
    assert len(AutoTokenizer.from_pretrained(reference_run / "final")) == 50257
    assert (reference_run / "config.yaml").is_file() and (reference_run / "run_info.json").is_file()


def test_keeps_only_the_last_checkpoints(reference_run):
    kept = sorted(p.name for p in (reference_run / "checkpoints").iterdir())
    assert kept == ["step_20", "step_24"]
    state = json.loads((reference_run / "checkpoints" / "step_24" / "trainer_state.json").read_text())
    assert state["trainer"]["step"] == 24 and state["trainer"]["micro_batches"] == 24 * 2


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted_run(reference_run, data_cache, tmp_path):
    out = tmp_path / "killed"
    kill_when_ready(train_args(out, data_cache), out / "checkpoints" / "step_8")
    assert not (out / "final").exists(), "the run finished before it was killed; nothing was tested"
    killed_at = max(last_by_step(out, "train/loss"))

    resumed = run_script(train_args(out, data_cache, "--resume_from_checkpoint", "latest"), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    for key in ("train/loss", "train/lr", "train/grad_norm", "val/loss"):
        expected, got = last_by_step(reference_run, key), last_by_step(out, key)
        assert sorted(got) == sorted(expected), key
        for step in expected:
            assert math.isclose(got[step], expected[step], rel_tol=1e-5, abs_tol=1e-7), (key, step, killed_at)


@pytest.mark.slow
def test_injected_spike_rolls_back_once_with_lower_lr(data_cache, tmp_path):
    out = tmp_path / "spike"
    proc = run_script(
        train_args(
            out,
            data_cache,
            "--max_steps",
            "14",
            "--inject_spike",
            "10:50",
            "--spike_window",
            "4",
            "--spike_patience",
            "2",
            "--log_every",
            "3",
        )
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = read_jsonl(out / "events.jsonl")
    assert [e["event"] for e in events] == ["rollback"]
    assert events[0]["step"] == 11 and events[0]["resumed_step"] == 8 and events[0]["lr_scale"] == pytest.approx(0.8)
    # the losses are read at log and save steps (3, 4, 6, 8, 9, 12): step 11's patience is seen at step 12, and the
    # rollback is the one it would have been at step 11, step 12's data included in what is not skipped
    assert events[0]["seen_at_step"] == 12
    assert events[0]["skipped_micro_batches"] == 3 * 2  # steps 9-11 of data are skipped
    lrs = {}
    for rec in read_jsonl(out / "metrics.jsonl"):
        if "train/lr" in rec:
            lrs.setdefault(rec["step"], []).append(rec["train/lr"])
    assert len(lrs[9]) == 2 and lrs[9][1] == pytest.approx(0.8 * lrs[9][0])  # step 9 ran before and after
    assert lrs[14][0] > 0 and (out / "final").is_dir()
    assert "train/rollbacks" in {k for r in read_jsonl(out / "metrics.jsonl") for k in r}

    gave_up = run_script(
        train_args(
            tmp_path / "gave_up",
            data_cache,
            "--max_steps",
            "14",
            "--inject_spike",
            "10:50",
            "--spike_window",
            "4",
            "--spike_patience",
            "2",
            "--max_rollbacks",
            "0",
        )
    )
    assert_one_line_error(gave_up, "loss kept spiking", "--max_rollbacks")
    assert read_jsonl(tmp_path / "gave_up" / "events.jsonl")[-1]["event"] == "gave_up"


def test_spike_detector_counts_nan_and_needs_patience():
    from llmlab.train.spikes import SpikeDetector, parse_inject_spike

    detector = SpikeDetector(factor=2.0, window=3, patience=2)
    assert not any(detector.update(x) for x in (4.0, 3.9, 3.8))
    assert not detector.update(9.0)  # one spiking step is not enough
    assert not detector.update(3.7)  # a normal step resets the streak
    assert not detector.update(float("nan"))
    assert detector.update(float("inf"))
    assert detector.history[-1] == 3.7  # spikes never enter the reference window
    assert parse_inject_spike("50") == (50, 10.0) and parse_inject_spike("7:3.5") == (7, 3.5)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--batch_size", "0"], "--batch_size"),
        (["--batch_size", "4", "--effective_batch_size", "6"], "multiple of --batch_size"),
        (["--clip", "sometimes"], "--clip"),
        (["--inject_spike", "soon"], "--inject_spike"),
        (["--min_lr", "1.0"], "--min_lr"),
        (["--block_size", "512"], "context length"),
        (["--rollback_lr_factor", "1.5"], "--rollback_lr_factor"),
        (["--spike_factor", "1"], "--spike_factor"),
        (["--loss_chunk_tokens", "-1"], "--loss_chunk_tokens"),
        (["--sample_tokens", "-1"], "--sample_tokens"),
        (["--cpu_threads", "-2"], "--cpu_threads"),
        (["--learning_rate", "nan"], "--learning_rate"),
    ],
)
def test_bad_options_are_user_errors(argv, fragment):
    from llmlab.core.config import parse_config
    from llmlab.train.pretrain.config import PretrainConfig

    with pytest.raises(UserError, match=fragment.replace("-", r"\-")):
        parse_config(PretrainConfig, argv)


def test_preset_defaults_and_recommend_yaml(tmp_path):
    import yaml

    from llmlab.core.config import parse_config
    from llmlab.train.pretrain.config import PretrainConfig

    tiny = parse_config(PretrainConfig, [])
    assert (tiny.block_size, tiny.max_steps, tiny.warmup_steps, tiny.effective_batch_size) == (128, 190, 19, 8)
    assert (tiny.learning_rate, tiny.mixed_precision, tiny.loss_chunk_tokens) == (2e-3, "auto", 1024)
    big = parse_config(PretrainConfig, ["--model", "gpt2"])
    assert (big.block_size, big.warmup_steps, big.effective_batch_size, big.learning_rate) == (1024, 2000, 512, 6e-4)
    assert (big.adam_beta1, big.adam_beta2, big.adam_eps, big.weight_decay, big.min_lr) == (0.9, 0.98, 1e-6, 0.1, 1e-5)
    recommended = tmp_path / "recommended.yaml"  # the keys `sweep.py recommend` writes
    recommended.write_text(
        yaml.safe_dump(
            {"learning_rate": 2.5e-4, "effective_batch_size": 64, "batch_size": 16, "warmup_steps": 120, "clip": "0.9"}
        )
    )
    cfg = parse_config(PretrainConfig, ["--config", str(recommended), "--model", "gpt2"])
    assert (cfg.learning_rate, cfg.effective_batch_size, cfg.batch_size, cfg.warmup_steps, cfg.clip) == (
        2.5e-4,
        64,
        16,
        120,
        "0.9",
    )
    assert parse_config(PretrainConfig, ["--clip", "adaptive", "--label_smoothing", "0.1"]).clip == "adaptive"


def test_unreadable_checkpoints_are_refused(reference_run, data_cache, tmp_path):
    import shutil

    from llmlab.train.checkpointing import read_trainer_state, resolve_checkpoint

    with pytest.raises(UserError, match="no checkpoint"):
        resolve_checkpoint(tmp_path / "empty", "latest")
    damaged = tmp_path / "out" / "checkpoints" / "step_24"
    shutil.copytree(reference_run / "checkpoints" / "step_24", damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    with pytest.raises(UserError, match="damaged"):
        read_trainer_state(damaged)
    (damaged / "trainer_state.json").write_text("{not json")
    with pytest.raises(UserError, match="unreadable"):
        read_trainer_state(damaged)
    (damaged / "trainer_state.json").unlink()
    with pytest.raises(UserError, match="incomplete"):
        read_trainer_state(damaged)

    # Same sizes, garbage content: only loading can tell; the CLI still answers in one line.
    garbage = tmp_path / "garbage"
    shutil.copytree(reference_run / "checkpoints" / "step_24", garbage)
    optimizer_file = garbage / "optimizer.bin"
    optimizer_file.write_bytes(b"\0" * optimizer_file.stat().st_size)
    proc = run_script(train_args(tmp_path / "resume", data_cache, "--resume_from_checkpoint", str(garbage)))
    assert_one_line_error(proc, "unreadable", str(garbage))


def test_cli_errors_are_one_line(tmp_path):
    proc = run_script(["train_pretrain.py", "--output_dir", str(tmp_path), "--resume_from_checkpoint", "latest"])
    assert_one_line_error(proc, "no checkpoint")
    proc = run_script(["train_pretrain.py", "--batch_size", "0"])
    assert_one_line_error(proc, "--batch_size")


def test_prepare_only_prints_summary_and_rejects_bad_input(tmp_path):
    proc = run_in_process(
        [
            "train_pretrain.py",
            "--prepare_only",
            "--max_documents",
            "3",
            "--block_size",
            "32",
            "--cache_dir",
            str(tmp_path / "cache"),
            "--output_dir",
            str(tmp_path / "out"),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cleaning step" in proc.stdout and "blocks of 32" in proc.stdout
    assert json.loads((tmp_path / "out" / "prepare_report.json").read_text())["block_size"] == 32
    proc = run_in_process(
        [
            "train_pretrain.py",
            "--prepare_only",
            "--dataset",
            str(tmp_path / "missing.jsonl"),
            "--output_dir",
            str(tmp_path / "out2"),
        ]
    )
    assert_one_line_error(proc, "missing.jsonl")


def test_half_written_checkpoint_is_never_picked(tmp_path):
    from llmlab.train.checkpointing import latest_checkpoint, list_checkpoints, remove_partial_saves

    root = tmp_path / "checkpoints"
    (root / "step_4").mkdir(parents=True)
    (root / ".tmp-step_8").mkdir()  # what a save killed before its rename leaves behind
    (root / ".tmp-step_8" / "model.safetensors").write_bytes(b"partial")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_4"]
    assert latest_checkpoint(tmp_path).name == "step_4"
    remove_partial_saves(tmp_path)
    assert not (root / ".tmp-step_8").exists() and (root / "step_4").is_dir()


def test_recommended_yaml_drives_a_real_run_with_its_optimizer_and_schedule(data_cache, tmp_path):
    """`sweep.py recommend` -> YAML -> train_pretrain.py: the run resolves the YAML's optimizer, schedule, lr and
    parametrization (a muP scan of GPT-2 probes: muP at the scan's base width), shape and length overridden on the
    command line to stay tiny, and logs the lr that schedule gives."""
    import yaml

    from llmlab.scaling.recommend import recommend_main
    from llmlab.scaling.report import write_lr_bs_report
    from llmlab.train.optim import OPTIMIZERS, lr_multiplier
    from tests.scaling.test_scaling import SYNTHETIC_OPTIONS, planted_scan

    scan = tmp_path / "scan"
    write_lr_bs_report(scan, planted_scan(seed=0), SYNTHETIC_OPTIONS)
    (scan / "config.yaml").write_text("model: gpt2\nparametrization: mup\nmup_base_width: 32\n")  # the sweep's
    rec_path = tmp_path / "rec.yaml"
    rec = recommend_main(
        [
            "--from",
            str(scan),
            "--memory-gb",
            "24",
            "--params",
            "50000000",
            "--optimizer",
            "lion",
            "--output",
            str(rec_path),
        ]
    )
    written = yaml.safe_load(rec_path.read_text())
    assert written["optimizer"] == "lion" and written["lr_scheduler"] == "cosine"
    assert written["parametrization"] == "mup" and written["mup_base_width"] == 32
    out = tmp_path / "run"
    proc = run_in_process(
        [
            "train_pretrain.py",
            "--config",
            str(rec_path),
            "--n_layer",
            "1",
            "--n_embd",
            "64",
            "--n_head",
            "1",
            "--block_size",
            "32",
            "--batch_size",
            "2",
            "--effective_batch_size",
            "2",
            "--max_steps",
            "6",
            "--warmup_steps",
            "2",
            "--max_documents",
            "5",
            "--eval_every",
            "0",
            "--eval_batches",
            "1",
            "--sample_tokens",
            "0",
            "--cache_dir",
            data_cache,
            "--output_dir",
            str(out),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["optimizer"] == "lion" and resolved["lr_scheduler"] == "cosine"
    assert resolved["learning_rate"] == pytest.approx(rec["learning_rate"], rel=1e-3)
    assert "optimizer Lion, cosine schedule" in proc.stdout
    assert resolved["parametrization"] == "mup" and "muP (base width 32, m = 2)" in proc.stdout
    logged = last_by_step(out, "train/lr")
    ratio = resolved["min_lr"] / resolved["learning_rate"]
    for step, lr in logged.items():  # the lr of step s is the schedule's at s - 1; Lion's is lr / 3
        expected = (
            resolved["learning_rate"] / OPTIMIZERS["lion"].lr_divisor * lr_multiplier(step - 1, "cosine", 2, 6, ratio)
        )
        assert lr == pytest.approx(expected, rel=1e-6), step
