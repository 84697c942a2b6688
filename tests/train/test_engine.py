"""The one training step (llmlab.train.engine): the trainers and the lab's trials run it, and it gives the losses the
code before it gave, so the shipped scans stay comparable and resumable."""

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from llmlab.core.runinfo import machine_label
from tests.conftest import REPO, tiny_trial
from tests.train.test_pretrain import SMALL

GOLDEN = Path(__file__).with_name("engine_golden.json")
TRIALS = {
    "adamw": {},
    "lion_acc2_value": {"optimizer": "lion", "accumulation": 2, "clip": 0.5, "clip_mode": "value"},
    "adafactor_poly_smooth": {"optimizer": "adafactor", "scheduler": "polynomial", "label_smoothing": 0.1},
    "adamw_bf16_compiled": {},
}


def trial_curves(name: str, tmp: Path) -> dict:
    from llmlab.sweep.trial import train_attempt

    levels = {"warmup": 2, "lr": 3e-3, "position_encoding": "rope", **TRIALS[name]}
    hp, spec, data = tiny_trial(tmp, name, **levels)
    spec = replace(spec, steps=6, log_every=2)
    if name == "adamw_bf16_compiled":
        spec = replace(spec, compile=True, precision="bf16")
    run = train_attempt(spec, hp, data, torch.device("cpu"), tmp / "log", time.time())
    return {k: run["curves"][k] for k in ("loss", "grad_norm", "lr")} | {"val_loss": run["summary"]["val_loss"]}


def pretrain_curves(tmp: Path) -> dict:
    args = [
        sys.executable,
        "train_pretrain.py",
        *SMALL,
        "--max_steps",
        "6",
        "--log_every",
        "1",
        "--eval_every",
        "6",
        "--save_every",
        "100",
        "--cache_dir",
        str(tmp / "cache"),
        "--output_dir",
        str(tmp / "run"),
        "--report_to",
        "none",
        "--cpu_threads",
        "1",
        "--mixed_precision",
        "no",
    ]  # pinned: the default follows the CPU (bf16 where it has bf16 units)
    proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return {k: [m[k] for m in metrics if k in m] for k in ("train/loss", "train/grad_norm", "train/lr", "val/loss")}


def test_the_engine_gives_the_losses_of_the_code_before_it(tmp_path):
    """To 1e-6 on a CPU kind the golden file holds (it was bit-identical when written); on another kind, fp32 runs
    to 1e-3 (float rounding differs between CPUs) and the bf16 one is left out (its kernels differ there). Every
    compared run pins its precision: the pretraining run's default would be bf16 on a CPU with bf16 units."""
    golden = json.loads(GOLDEN.read_text())["machines"]
    here = machine_label()
    reference = golden.get(here) or next(iter(golden.values()))
    tolerance = 1e-6 if here in golden else 1e-3
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        measured = {
            f"trial/{name}": trial_curves(name, tmp_path / name)
            for name in TRIALS
            if here in golden or "bf16" not in name
        }
    finally:
        torch.set_num_threads(threads)
    measured["pretrain"] = pretrain_curves(tmp_path / "pretrain")
    for run, curves in measured.items():
        for key, values in curves.items():
            expected = reference[run][key]
            assert np.allclose(values, expected, rtol=0, atol=tolerance), (run, key, values, expected)


def test_a_trial_and_the_trainers_step_through_the_same_engine():
    from llmlab.sweep.trial import TrialSetup
    from llmlab.train.engine import AccelerateBackend, Engine, TorchBackend
    from llmlab.train.session import TrainingSession

    assert TrialSetup.__dataclass_fields__["engine"].type in ("Engine", Engine)
    import inspect

    assert "AccelerateBackend(self.accelerator)" in inspect.getsource(TrainingSession.__init__)
    assert "clip_grad_norm_" not in inspect.getsource(sys.modules["llmlab.sweep.trial"])  # no second copy of the step
    assert "optimizer.step()" not in inspect.getsource(sys.modules["llmlab.train.session"])
    assert TorchBackend and AccelerateBackend


def test_a_trials_fp16_overflow_goes_to_its_scaler_and_the_next_step_runs():
    """The trial's fp16 path (TorchBackend + GradScaler), on CPU with torch's CPU GradScaler: the first, overflowed
    step is the scaler's to skip (no update, a lower scale), the next one updates."""
    from llmlab.train.engine import Engine, GradClipper, TorchBackend

    model = torch.nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**126)  # 4 x 2^126 overflows fp32
    engine, clipper = Engine(TorchBackend(scaler)), GradClipper("0.5")
    before = model.weight.detach().clone()
    results = []
    for step in range(2):
        engine.backward(model(torch.tensor([[3.0, 4.0]])).sum())
        results.append(engine.step(model.parameters(), optimizer, scheduler, clipper, step).read())
    assert results[0].overflow and not results[0].stepped and scaler.get_scale() == 2.0**125
    assert results[1].stepped and results[1].grad_norm == pytest.approx(5.0) and results[1].clipped
    assert torch.allclose(before - model.weight.detach(), 0.1 * torch.tensor([[0.3, 0.4]]))
