"""The component registries (llmlab.train.components): one entry makes an optimizer or a schedule a choice of both
trainers, a level of the lab's trials, a recommend option and a memory-model row."""

import json
import os

import pytest

from llmlab.core.errors import UserError
from llmlab.train import components
from tests.conftest import REPO, run_script
from tests.train.test_lora import TINY_RUN
from tests.train.test_pretrain import SMALL

PLUGIN = """
import json, os
import torch
from accelerate.tracking import GeneralTracker, register_tracker_class
from llmlab.train.components import OptimizerEntry, ScheduleEntry, register_optimizer, register_schedule

def build(groups, lr, betas, eps):
    print("PLUGIN SGD BUILT", flush=True)
    return torch.optim.SGD(groups, lr=lr, momentum=0.9)

register_optimizer("plugin_sgd", OptimizerEntry(build, state_bytes=4.0, deepspeed=False, label="SGD"))
register_schedule("plugin_step", ScheduleEntry(lambda progress: 1.0 if progress < 0.5 else 0.1, "a step decay"))


class PluginTracker(GeneralTracker):  # accelerate's own tracker registry: a --report_to name for every script
    name = "plugin_tracker"
    requires_logging_directory = True
    main_process_only = True

    def __init__(self, project, logging_dir, **kwargs):
        super().__init__()
        self.path = os.path.join(logging_dir, "plugin_tracker.jsonl")

    @property
    def tracker(self):
        return self.path

    def store_init_configuration(self, values):
        self.log({"config_keys": len(values)})

    def log(self, values, step=None, **kwargs):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\\n")


register_tracker_class(PluginTracker)
"""


def test_the_shipped_entries_keep_their_conventions():
    assert components.OPTIMIZERS["lion"].lr_divisor == 3.0  # the documented Lion convention
    assert {n: e.state_bytes for n, e in components.OPTIMIZERS.items()} == {
        "adamw": 8.0,
        "adamw-foreach": 8.0,
        "lion": 4.0,
        "adafactor": 0.0,
        "muon": 8.0,
    }
    assert [n for n, e in components.OPTIMIZERS.items() if e.deepspeed] == ["adamw"]
    shares = {n: e.mean_lr_share() for n, e in components.SCHEDULES.items()}
    expected = {"linear": 0.5, "cosine": 0.5, "polynomial": 1 / 3, "constant": 1.0, "wsd": 0.9}  # wsd: 0.8 + 0.2 / 2
    assert shares == pytest.approx(expected, abs=2e-3)


def test_a_plugin_that_cannot_be_imported_is_one_line(tmp_path):
    proc = run_script(["train_pretrain.py", "--help"], env={"LLMLAB_PLUGINS": "no_such_plugin_module"})
    assert proc.returncode != 0 and "LLMLAB_PLUGINS" in proc.stderr and "no_such_plugin_module" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_optimizer_and_schedule_registered_in_one_place_train_everywhere(
    tmp_path, tiny_gpt2_dir, pydoc_cache_dir, pretrain_cache
):
    """One plugin module (LLMLAB_PLUGINS) registers SGD, a step schedule and a tracker: pretraining, LoRA and a sweep
    trial build and log to them. Real processes: each imports the plugin itself."""
    (tmp_path / "llmlab_test_plugin.py").write_text(PLUGIN)
    env = {
        "LLMLAB_PLUGINS": "llmlab_test_plugin",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    chosen = ["--optimizer", "plugin_sgd", "--lr_scheduler", "plugin_step", "--report_to", "plugin_tracker"]
    pre = run_script(
        [
            "train_pretrain.py",
            *SMALL,
            "--cache_dir",
            str(pretrain_cache),
            "--max_steps",
            "3",
            "--output_dir",
            str(tmp_path / "pre"),
            *chosen,
        ],
        env=env,
        timeout=600,
    )
    assert pre.returncode == 0 and "PLUGIN SGD BUILT" in pre.stdout, pre.stderr[-2000:]
    lora = run_script(
        [
            "train_lora.py",
            "--base_model",
            str(tiny_gpt2_dir),
            "--cache_dir",
            str(pydoc_cache_dir),
            *TINY_RUN,
            "--max_steps",
            "2",
            "--output_dir",
            str(tmp_path / "lora"),
            *chosen,
        ],
        env=env,
        timeout=600,
    )
    assert lora.returncode == 0 and "PLUGIN SGD BUILT" in lora.stdout, lora.stderr[-2000:]
    (tmp_path / "grid.yaml").write_text("trials:\n  - {optimizer: plugin_sgd, scheduler: plugin_step}\n")
    sweep = run_script(
        [
            "sweep.py",
            "--grid",
            str(tmp_path / "grid.yaml"),
            "--budget",
            "smoke",
            "--workers",
            "1",
            "--output_dir",
            str(tmp_path / "sweep"),
            "--data_cache_dir",
            str(tmp_path / "cache"),
            "--report_to",
            "plugin_tracker",
        ],
        env=env,
        timeout=600,
    )
    assert sweep.returncode == 0, sweep.stderr[-2000:]
    (trial,) = [p for p in (tmp_path / "sweep" / "trials").iterdir() if p.is_dir()]
    result = json.loads((trial / "result.json").read_text())
    assert result["status"] == "ok" and "PLUGIN SGD BUILT" in (trial / "log.txt").read_text()
    for run in ("pre", "lora"):
        config = (tmp_path / run / "config.yaml").read_text()
        assert "optimizer: plugin_sgd" in config and "lr_scheduler: plugin_step" in config
    for folder in (tmp_path / "pre", tmp_path / "lora", trial):
        logged = [json.loads(line) for line in (folder / "plugin_tracker.jsonl").read_text().splitlines()]
        assert logged[0]["config_keys"] > 5 and any("train/loss" in row for row in logged), folder
        assert not (folder / "tensorboard").exists()  # --report_to names the trackers: only the plugin's here


def test_recommend_and_the_memory_model_read_the_registry(monkeypatch):
    from llmlab.core.config import build_config
    from llmlab.scaling import memory
    from llmlab.scaling.recommend import RecommendConfig

    with pytest.raises(
        UserError, match="--optimizer: 'plugin_sgd' is not one of adamw, adamw-foreach, lion, adafactor"
    ):
        build_config(RecommendConfig, {"optimizer": "plugin_sgd"})
    monkeypatch.setitem(
        components.OPTIMIZERS,
        "plugin_sgd",
        components.OptimizerEntry(lambda *a: None, state_bytes=4.0, deepspeed=False),
    )
    with pytest.raises(UserError, match="--from is required"):  # the optimizer passed; the next check speaks
        build_config(RecommendConfig, {"optimizer": "plugin_sgd"})
    assert memory.state_bytes_per_param("plugin_sgd", 0, False, "bf16") == 4.0 + 4.0 + 4.0


def test_one_model_registry_builds_the_trainers_and_the_labs_models_with_their_facts():
    """The trainer, a lab trial and a scan's size all build through llmlab.models.registry: a trial's GPT-2 probe is
    the registry's (same weights from the same seed), a scan's N is the registry's, its FLOPs per token follow
    PaLM's 6 N + 12 L d T, and an unknown model or parametrisation is one line."""
    import torch

    from llmlab.core.errors import UserError
    from llmlab.models.registry import MODELS, build_model, model_facts
    from llmlab.scaling.scan import size_parameters
    from llmlab.sweep.factors import REGISTRY
    from llmlab.sweep.spec import Hparams, TrialSpec
    from llmlab.sweep.trial import build_trial_model

    hp = Hparams(**{**{name: None for name in REGISTRY}, "position_encoding": "rope"})
    shape = dict(model="gpt2", model_width=128, model_depth=2, parametrization="mup", mup_base_width=64, block_size=64)
    spec = TrialSpec(trial_id="t", trial_dir="", data_dir="", hparams=hp, seed=0, steps=1, **shape)
    torch.manual_seed(0)
    trial = build_trial_model(spec, hp)
    torch.manual_seed(0)
    direct = build_model("gpt2", 128, 2, 64, "mup", 64, head_dim=MODELS["gpt2"].head_dim)
    assert trial.config.n_head == 2 and all(torch.equal(a, b) for a, b in zip(trial.parameters(), direct.parameters()))
    facts = model_facts("gpt2", 128, 2, 64)
    assert (
        facts["non_embedding"] == size_parameters("128x2", "gpt2", 64) == trial.num_parameters(exclude_embeddings=True)
    )
    assert (
        facts["flops_per_token"] == 6 * facts["total"] + 12 * 2 * 128 * 64 and facts["total"] == trial.num_parameters()
    )
    minimal = model_facts("minimal", 64, 2, 128, head_dim=32)
    assert minimal["non_embedding"] == size_parameters("64x2", "minimal", 32) and minimal["parametrizations"] == (
        "standard",
        "mup",
    )
    with pytest.raises(UserError, match="unknown model 'gpt5'"):
        build_model("gpt5")
    with pytest.raises(UserError, match="no 'ntk' parametrization"):
        build_model("gpt2-tiny", parametrization="ntk")
