"""DeepSpeed / accelerate configs: every shipped file loads and validates; ZeRO-2 + CPU offload really trains."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmlab.core.io import read_jsonl
from tests.conftest import REPO

ACCELERATE_CONFIGS = sorted((REPO / "accelerate_configs").glob("*.yaml"))
DS_CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))


def filled(ds_config: dict) -> dict:
    """The DeepSpeed config with its "auto" values filled in the way accelerate fills them."""
    config = json.loads(json.dumps(ds_config))
    config.update(gradient_accumulation_steps=2, gradient_clipping=1.0, train_micro_batch_size_per_gpu=4,
                  train_batch_size=8)
    config["bf16"]["enabled"], config["fp16"]["enabled"] = True, False
    return config


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.name)
def test_deepspeed_configs_validate(path):
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.runtime.config import DeepSpeedConfig

    raw = json.loads(path.read_text())
    for key in ("gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                "train_micro_batch_size_per_gpu"):
        assert raw[key] == "auto", key  # accelerate fills these from the trainer, so they never disagree
    assert DeepSpeedPlugin(hf_ds_config=str(path)).zero_stage == 2
    checked = DeepSpeedConfig(filled(raw))
    assert checked.zero_optimization_stage == 2
    offload = checked.zero_config.offload_optimizer
    assert (offload is not None and offload.device == "cpu") == ("offload" in path.name)


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_configs_load(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    raw = yaml.safe_load(path.read_text())
    assert config.num_processes >= 1 and config.num_machines >= 1
    if config.distributed_type.value == "DEEPSPEED":
        ds_file = REPO / config.deepspeed_config["deepspeed_config_file"]
        assert ds_file in DS_CONFIGS
        # accelerate refuses these next to a deepspeed_config_file; precision comes from the json's "auto"
        assert "mixed_precision" not in raw and "gradient_accumulation_steps" not in raw["deepspeed_config"]


def test_all_four_setups_are_shipped():
    names = {p.stem for p in ACCELERATE_CONFIGS}
    assert {"cpu", "one_gpu", "one_gpu_zero2_offload", "multi_gpu_zero2"} <= names
    multi = yaml.safe_load((REPO / "accelerate_configs" / "multi_gpu_zero2.yaml").read_text())
    assert {"num_machines", "machine_rank", "main_process_ip", "main_process_port"} <= set(multi)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, cache: Path, *extra: str):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "accelerate_configs" / "one_gpu_zero2_offload.yaml"), "--main_process_port", str(free_port()),
           "train_pretrain.py", "--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--block_size", "32",
           "--batch_size", "2", "--effective_batch_size", "4", "--max_documents", "5", "--learning_rate", "1e-2",
           "--eval_batches", "2", "--eval_every", "2", "--save_every", "2", "--mixed_precision", "bf16",
           "--cache_dir", str(cache), "--output_dir", str(out), *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_zero2_cpu_offload_trains_saves_and_resumes(tmp_path):
    """Real DeepSpeed ZeRO-2 with the optimizer on CPU (DeepSpeedCPUAdam; first use JIT-compiles it)."""
    out = tmp_path / "ds"
    first = launch(out, tmp_path / "cache", "--max_steps", "4")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "optimizer DeepSpeedCPUAdam" in first.stdout and "DEEPSPEED" in first.stdout
    assert (out / "checkpoints" / "step_4" / "pytorch_model").is_dir()  # ZeRO's own checkpoint layout

    resumed = launch(out, tmp_path / "cache", "--max_steps", "6", "--resume_from_checkpoint", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    losses = {r["step"]: r["train/loss"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and all(l == l for l in losses.values())
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "final").config.n_embd == 32


def test_fp16_on_cpu_is_refused_clearly(tmp_path):
    from accelerate.state import AcceleratorState

    from llmlab.core.config import parse_config
    from llmlab.core.errors import UserError
    from llmlab.train.loop import TrainingSession
    from llmlab.train.pretrain import PretrainConfig

    import torch

    if torch.cuda.is_available():
        pytest.skip("fp16 is valid on a GPU")
    try:
        with pytest.raises(UserError, match="fp16 needs a GPU"):
            cfg = parse_config(PretrainConfig, ["--mixed_precision", "fp16", "--output_dir", str(tmp_path / "run")])
            TrainingSession(cfg, "pretraining", run_files=(), resumable=(), mixed_precision=cfg.mixed_precision)
        assert not (tmp_path / "run").exists()  # refused before anything was written
    finally:
        AcceleratorState._reset_state(True)
