"""muP for GPT-2 (llmlab/models/mup.py) in the trainer: the model it builds, the lrs it trains with, a final/ that is a
plain GPT-2 with the same logits, exact resume, LoRA on its output, its refusals, and the coordinate check."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from llmlab.core.io import read_jsonl
from tests.conftest import kill_when_ready, run_in_process, run_script, tiny_pretrain_args

# 64 wide at base width 32: m = 2, so every muP rule is visible (hidden lr / 2, readout / 2, init std / sqrt 2)
MUP = ["--parametrization", "mup", "--mup_base_width", "32"]
STEPS = 9


def run_args(out: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "train_pretrain.py",
        *tiny_pretrain_args(n_embd=64, n_head=1, learning_rate="1e-2", mixed_precision="no", sample_tokens=0),
        *MUP,
        "--cache_dir",
        str(cache),
        "--output_dir",
        str(out),
        "--report_to",
        "none",
        "--save_every",
        "3",
        *extra,
    ]


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r}


def test_mup_at_its_base_width_is_the_standard_model_bit_for_bit():
    from llmlab.models.gpt2 import build_gpt2_model
    from llmlab.models.mup import lr_multipliers

    shape = {"n_layer": 2, "n_embd": 128, "n_head": 2}
    torch.manual_seed(0)
    standard = build_gpt2_model("gpt2-tiny", **shape).eval()
    torch.manual_seed(0)
    mup = build_gpt2_model("gpt2-tiny", parametrization="mup", mup_base_width=128, **shape).eval()
    ids = torch.randint(0, 50257, (2, 16))
    assert torch.equal(standard(ids).logits, mup(ids).logits)
    assert set(lr_multipliers(mup).values()) == {1.0}


def test_mup_scales_hidden_init_and_lr_and_the_readout_by_width():
    from llmlab.models.gpt2 import build_gpt2_model
    from llmlab.models.mup import HIDDEN_MATRICES, lr_multipliers, width_mult

    torch.manual_seed(0)
    model = build_gpt2_model("gpt2-tiny", parametrization="mup", mup_base_width=64, n_layer=2, n_embd=256, n_head=4)
    assert width_mult(model) == 4.0 and model.transformer.ln_f.readout_multiplier == 0.25
    multipliers = lr_multipliers(model)
    for name, _ in model.named_parameters():
        assert multipliers[name] == (0.25 if name.endswith(HIDDEN_MATRICES) else 1.0), name
    c_fc, c_proj = (model.transformer.h[0].mlp.c_fc.weight.detach(), model.transformer.h[0].mlp.c_proj.weight.detach())
    assert math.isclose(float(c_fc.std()), 0.02 / 2, rel_tol=0.02)  # 0.02 / sqrt(m)
    assert math.isclose(float(c_proj.std()), 0.02 / 2 / math.sqrt(4), rel_tol=0.02)  # and GPT-2's 1 / sqrt(2 L)
    assert math.isclose(float(model.transformer.wte.weight.detach().std()), 0.02, rel_tol=0.02)  # embeddings unchanged


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory) -> tuple[Path, Path, str]:
    """A muP run of STEPS steps: (its folder, the data cache, its stdout)."""
    tmp = tmp_path_factory.mktemp("mup")
    proc = run_script(run_args(tmp / "whole", tmp / "cache", "--max_steps", str(STEPS)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "whole", tmp / "cache", proc.stdout


@pytest.mark.slow
def test_final_is_a_plain_gpt2_with_the_trained_models_logits_and_resume_is_exact(tmp_path, whole_run):
    """A muP run's final/ loads in plain transformers and gives the logits the muP model of its last checkpoint
    gives; a run SIGKILLed after a checkpoint and resumed matches the uninterrupted run step by step."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from llmlab.models.gpt2 import build_gpt2_model

    whole, cache, stdout = whole_run
    assert "muP (base width 32, m = 2)" in stdout

    plain = AutoModelForCausalLM.from_pretrained(whole / "final").eval()
    assert type(plain.transformer.ln_f) is torch.nn.LayerNorm  # a plain GPT-2: nothing of llmlab in it
    trained = build_gpt2_model("gpt2-tiny", parametrization="mup", mup_base_width=32, n_layer=1, n_embd=64, n_head=1)
    saved = load_file(whole / "checkpoints" / f"step_{STEPS}" / "model.safetensors")
    state = {k.removeprefix("model."): v for k, v in saved.items()}
    trained.load_state_dict(state, strict=False)
    trained.tie_weights()
    trained.eval()
    ids = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before, after = trained(ids).logits, plain(ids).logits
    assert torch.allclose(before, after, atol=1e-5, rtol=0), float((before - after).abs().max())
    assert float(before.std()) > 0.01  # not a vacuous comparison of two near-zero outputs

    part = tmp_path / "part"
    kill_when_ready(run_args(part, cache, "--max_steps", str(STEPS)), part / "checkpoints" / "step_3")
    assert not (part / "final").exists(), "the run finished before it was killed; nothing was tested"
    resumed = run_script(run_args(part, cache, "--max_steps", str(STEPS), "--resume_from_checkpoint", "latest"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(part) == losses(whole)
    # resuming it as a standard model would train another model from its weights: refused in one line
    standard = run_args(part, cache, "--max_steps", str(STEPS + 2), "--resume_from_checkpoint", "latest")
    standard[standard.index("mup")] = "standard"
    refused = run_in_process(standard)
    assert refused.returncode == 2 and "parametrization" in refused.stderr.splitlines()[-1], refused.stderr[-2000:]


@pytest.mark.slow
def test_lora_adapts_a_mup_runs_final_model(tmp_path, pydoc_cache_dir, whole_run):
    """final/ of a muP run is a plain GPT-2, so train_lora.py adapts it as any other base (and lowers its loss)."""
    from tests.train.test_lora import _lora

    base = whole_run[0]
    _, report = _lora(["--learning_rate", "1e-2", "--max_steps", "6"], base / "final", pydoc_cache_dir, tmp_path / "l")
    assert report["after"]["validation"]["loss"] < report["before"]["validation"]["loss"], report


def test_mup_from_a_trained_model_is_refused_in_one_line(tmp_path, tiny_gpt2_dir):
    proc = run_in_process(
        ["train_pretrain.py", "--init_from", str(tiny_gpt2_dir), *MUP, "--output_dir", str(tmp_path / "x")]
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--parametrization mup builds a fresh model" in proc.stderr.splitlines()[-1]


def test_coordinate_check_is_flat_under_mup_and_grows_under_standard():
    """Tensor Programs V's check, through the trainer's builders, on tiny batches of real text: after a few AdamW
    steps the standard parametrization's attention and logits grow with width, muP's hidden coordinates do not."""
    from llmlab.train.coord_check import CoordCheck, run_coord_check, slopes

    cfg = CoordCheck(widths=(64, 128, 256), depth=2, steps=4, batch=2, seq=32, lr=3e-3, seeds=(0,))
    fitted = {(s["parametrization"], s["step"], s["what"]): s["slope"] for s in slopes(run_coord_check(cfg))}
    last = cfg.steps
    assert fitted["standard", last, "attn"] > 0.8 and fitted["standard", last, "logits"] > 0.5, fitted
    assert fitted["standard", last, "residual"] > 0.8
    for what in ("attn", "mlp", "residual"):
        assert abs(fitted["mup", last, what]) < 0.35, (what, fitted)
    # muP's readout starts at O(1 / sqrt(width)) (init std 0.02 / m on the effective head) and grows to O(1) with
    # training: its slope rises from -0.5, where the standard one starts at +0.5 and keeps growing
    assert fitted["mup", 1, "logits"] == pytest.approx(-0.5, abs=0.1)
    assert fitted["mup", last, "logits"] > fitted["mup", 1, "logits"] + 0.05
