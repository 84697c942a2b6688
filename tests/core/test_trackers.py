"""--report_to: accelerate's tracker API with metrics.jsonl as a small custom tracker (issue 12)."""

from __future__ import annotations

import json

import pytest

from llmlab.core.errors import UserError
from tests.conftest import run_in_process, run_script
from tests.train.test_pretrain import SMALL, assert_one_line_error


class FakeTracker:
    """A tracker a user might plug in: records what accelerate hands it."""

    name = "fake"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self):
        self.config, self.logged, self.started, self.finished = None, [], False, False

    @property
    def tracker(self):
        return self

    def start(self):
        self.started = True

    def store_init_configuration(self, values):
        self.config = values

    def log(self, values, step=None, **kwargs):
        self.logged.append((step, dict(values)))

    def finish(self):
        self.finished = True


@pytest.fixture
def single_process(monkeypatch):
    from accelerate.state import AcceleratorState

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(key, raising=False)
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_a_plugged_in_tracker_and_tensorboard_get_the_config_and_the_metrics(
    tmp_path, monkeypatch, single_process, pretrain_cache
):
    from accelerate.tracking import GeneralTracker

    from llmlab.core import tracking
    from llmlab.core.config import parse_config
    from llmlab.train.pretrain.loop import PretrainConfig, train

    fake = type("Fake", (FakeTracker, GeneralTracker), {})()
    original = tracking.make_trackers
    from llmlab.train import accelerator

    monkeypatch.setattr(accelerator, "make_trackers", lambda report_to, out: original(report_to, out) + [fake])
    out = tmp_path / "run"
    cfg = parse_config(
        PretrainConfig,
        [
            *SMALL,
            "--max_documents",
            "3",
            "--cache_dir",
            str(pretrain_cache),
            "--output_dir",
            str(out),
            "--max_steps",
            "4",
            "--eval_every",
            "4",
            "--save_every",
            "4",
        ],
    )
    summary = train(cfg)
    assert fake.started and fake.finished
    assert fake.config["learning_rate"] == 1e-2 and fake.config["max_steps"] == 4  # the resolved config
    assert fake.config["report_to"] == "['tensorboard']"  # lists become text: trackers take scalars only
    losses = {step: values["train/loss"] for step, values in fake.logged if "train/loss" in values}
    assert sorted(losses) == [1, 2, 3, 4] and any("val/loss" in values for _, values in fake.logged)
    jsonl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"]: r["train/loss"] for r in jsonl if "train/loss" in r} == losses  # the same numbers
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    runs = {p.parent for p in (out / "tensorboard").rglob("events.out.tfevents.*")}
    assert len(runs) == 1 and not list(out.rglob("hparams.yml"))  # one run: scalars and hparams together
    events = EventAccumulator(str(runs.pop())).Reload()
    start = plugin_data_pb2.HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    ).session_start_info
    assert start.hparams["learning_rate"].number_value == 1e-2 and "train/loss" in events.Tags()["scalars"]
    assert summary["step"] == 4


def test_report_to_none_keeps_metrics_jsonl_only(tmp_path, pretrain_cache):
    out = tmp_path / "run"
    proc = run_in_process(
        [
            "train_pretrain.py",
            *SMALL,
            "--max_documents",
            "3",
            "--cache_dir",
            str(pretrain_cache),
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--report_to",
            "none",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "metrics.jsonl").is_file() and not (out / "tensorboard").exists()


def test_a_missing_or_unknown_tracker_is_a_one_line_error(tmp_path):
    from llmlab.core.tracking import check_report_to

    with pytest.raises(UserError, match="--report_to neptune' is unknown|--report_to 'neptune' is unknown"):
        check_report_to(["neptune"])
    with pytest.raises(UserError, match="cannot be combined"):
        check_report_to(["none", "tensorboard"])
    assert check_report_to(["none"]) == [] and "tensorboard" in check_report_to(["all"])
    for script in ("train_pretrain.py", "train_lora.py"):
        proc = run_script(
            [script, "--report_to", "wandb", "--output_dir", str(tmp_path / script), "--base_model", str(tmp_path)]
            if script == "train_lora.py"
            else [script, "--report_to", "wandb", "--output_dir", str(tmp_path / script)]
        )
        assert_one_line_error(proc, "--report_to wandb", "pip install wandb")
