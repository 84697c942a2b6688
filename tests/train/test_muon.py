"""Muon in the registry (llmlab/train/muon.py) and the warmup-stable-decay schedule: the orthogonalised update, on
real small runs with exact resume and the state in the checkpoint, in the lab's trials, and their refusals."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from llmlab.core.errors import UserError
from llmlab.core.io import read_jsonl
from llmlab.train.optim import build_optimizer, check_deepspeed_choices, lr_multiplier
from tests.conftest import kill_when_ready, run_script, tiny_pretrain_args, tiny_trial


def one_step(name: str):
    """A 2-layer GPT-2 (64 wide, heads of 32) after one step of `name` at weight decay 0: (model before, after)."""
    from llmlab.models.gpt2 import build_gpt2_model
    from llmlab.models.mup import hidden_matrices

    torch.manual_seed(0)
    model = build_gpt2_model("gpt2-tiny", n_layer=2, n_embd=64, n_head=2)
    hidden = hidden_matrices(model)
    matrices = {id(p): hidden[n] for n, p in model.named_parameters() if n in hidden}
    optimizer = build_optimizer(name, model.parameters(), 1e-2, 0.0, matrices=matrices)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 50257, (8, 64), generator=torch.Generator().manual_seed(1))  # 512 tokens: full-rank grads
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    return before, dict(model.named_parameters()), optimizer


def singular_values(matrix: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(matrix.float())


def test_muons_update_is_orthogonal_per_matrix_and_qkv_as_three():
    """A hidden matrix's update is lr' x an approximately orthogonal matrix (Newton-Schulz's quintic leaves singular
    values in about [0.5, 1.5]; lr' = lr x 0.2 sqrt(max dim)), c_attn's as three square blocks; AdamW's are not. Held
    for 90 % of the singular values: 5 iterations leave the directions where the gradient is ~1000x below its norm
    small (and a matrix reading a LayerNorm's output has none along the all-ones input, which has zero mean)."""
    before, after, optimizer = one_step("muon")
    assert [g["muon"] for g in optimizer.param_groups].count(True) >= 1
    lr = 1e-2
    for name in ("transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_fc.weight"):
        update = before[name] - after[name].detach()
        blocks = update.chunk(3, dim=1) if "c_attn" in name else (update,)
        for block in blocks:
            scaled = singular_values(block) / (lr * 0.2 * max(block.shape) ** 0.5)
            assert float(((scaled > 0.4) & (scaled < 1.6)).float().mean()) >= 0.9, (name, scaled)
    whole = singular_values(before["transformer.h.0.attn.c_attn.weight"] - after["transformer.h.0.attn.c_attn.weight"])
    assert float(whole.max() / whole.min()) > 1.0  # three orthogonal blocks side by side: not one orthogonal matrix
    embedding = before["transformer.wte.weight"] - after["transformer.wte.weight"].detach()
    assert float(embedding.abs().max()) == pytest.approx(lr, rel=1e-3)  # AdamW's first step: lr x sign
    before, after, _ = one_step("adamw")
    spread = singular_values(before["transformer.h.1.mlp.c_fc.weight"] - after["transformer.h.1.mlp.c_fc.weight"])
    assert float(spread.quantile(0.9) / spread.quantile(0.1)) > 3  # Muon's: within [0.4, 1.6], a ratio below 4


def test_wsd_holds_the_peak_then_decays_over_its_fraction_in_its_shape():
    warm, total = 10, 110  # 100 steps after warmup
    for shape, middle in (("linear", 0.5), ("cosine", 0.5), ("sqrt", 1 - 0.5**0.5)):
        options = {"decay_fraction": 0.2, "decay_shape": shape}
        values = [lr_multiplier(s, "wsd", warm, total, 0.1, options) for s in range(total + 1)]
        assert values[warm:91] == pytest.approx([1.0] * (91 - warm))  # stable until 80 % of the run
        assert values[100] == pytest.approx(0.1 + 0.9 * middle)  # half way through the decay
        assert values[total] == pytest.approx(0.1)
    assert lr_multiplier(60, "wsd", 10, 110, 0.0, {"decay_fraction": 0.5}) == pytest.approx(1.0)
    assert lr_multiplier(85, "wsd", 10, 110, 0.0, {"decay_fraction": 0.5}) == pytest.approx(0.5)
    assert lr_multiplier(85, "cosine", 10, 110, 0.0, {"decay_fraction": 0.5}) == lr_multiplier(85, "cosine", 10, 110)


def run_args(out: Path, cache: Path, *extra: str) -> list[str]:
    options = tiny_pretrain_args(
        n_layer=2, n_embd=64, n_head=2, optimizer="muon", lr_scheduler="wsd", learning_rate="1e-2", save_every=3
    )
    return ["train_pretrain.py", *options, "--mixed_precision", "no", "--sample_tokens", "0", "--report_to", "none",
            "--cache_dir", str(cache), "--output_dir", str(out), *extra]  # fmt: skip


@pytest.mark.slow
def test_a_muon_wsd_run_learns_resumes_exactly_and_checkpoints_its_state(tmp_path, pretrain_cache):
    whole = tmp_path / "whole"
    proc = run_script(run_args(whole, pretrain_cache, "--max_steps", "6"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "optimizer MuonAdamW, wsd schedule" in proc.stdout
    losses = {r["step"]: r["train/loss"] for r in read_jsonl(whole / "metrics.jsonl") if "train/loss" in r}
    assert sum(losses[s] for s in (5, 6)) < sum(losses[s] for s in (1, 2)) - 0.3
    state = torch.load(whole / "checkpoints" / "step_6" / "optimizer.bin", weights_only=False)
    kinds = {frozenset(v) for v in state["state"].values()}
    assert frozenset({"momentum_buffer"}) in kinds and frozenset({"step", "exp_avg", "exp_avg_sq"}) in kinds
    assert sum(g["muon"] for g in state["param_groups"]) >= 1

    part = tmp_path / "part"
    kill_when_ready(run_args(part, pretrain_cache, "--max_steps", "6"), part / "checkpoints" / "step_3")
    assert not (part / "final").exists(), "the run finished before it was killed; nothing was tested"
    resumed = run_script(run_args(part, pretrain_cache, "--max_steps", "6", "--resume_from_checkpoint", "latest"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = {r["step"]: r["train/loss"] for r in read_jsonl(part / "metrics.jsonl") if "train/loss" in r}
    assert again == losses


def test_a_lab_trial_trains_with_muon_on_the_minimal_transformer(tmp_path):
    """The trial's optimizer is Muon on the minimal Transformer's hidden matrices (qkv as three), and it trains."""
    import math

    from llmlab.sweep.trial import build_setup, train_attempt
    from llmlab.train.muon import MuonAdamW

    hp, spec, data = tiny_trial(tmp_path, "muon", optimizer="muon", lr=1e-2, warmup=0, position_encoding="rope")
    setup = build_setup(spec, hp, torch.device("cpu"))
    assert isinstance(setup.optimizer, MuonAdamW)
    blocks = [b for g in setup.optimizer.param_groups if g["muon"] for b in g["blocks"]]
    assert (0, 3) in blocks and (0, 1) in blocks  # qkv as its three matrices, the others whole
    run = train_attempt(replace(spec, steps=4), hp, data, torch.device("cpu"), tmp_path / "log", time.time())
    assert len(run["curves"]["loss"]) == 4 and all(math.isfinite(x) and x < 11.0 for x in run["curves"]["loss"])


def test_muon_is_refused_in_one_line_where_it_cannot_work():
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=object()))
    with pytest.raises(UserError, match="--optimizer muon is not available under DeepSpeed"):
        check_deepspeed_choices(accelerator, "muon", "norm")
    proc = run_script(["train_lora.py", "--optimizer", "muon"])
    assert proc.returncode == 2 and "LoRA trains low-rank factors" in proc.stderr.splitlines()[-1]
    with pytest.raises(UserError, match="none are among the parameters it trains"):
        build_optimizer("muon", [torch.nn.Parameter(torch.zeros(4, 4))], 1e-3, 0.0)
