"""Host syncs per optimizer step: how often the step reads a tensor's value back to Python (item, float, int, bool,
tolist), each one a wait for the device on a GPU. Counted on CPU by wrapping those Tensor methods, for a sweep
trial's step and the trainers' step (TrainingSession, 2 micro-batches), in whichever llmlab is on PYTHONPATH:

    python bench/host_syncs.py                                  # this tree
    git worktree add /tmp/before 3c9b97c && PYTHONPATH=/tmp/before python bench/host_syncs.py   # before the engine
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

if importlib.util.find_spec("llmlab") is None:  # PYTHONPATH picks the tree to count; else this one
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SYNCS = ("item", "__float__", "__int__", "__bool__", "tolist")
COUNTS: Counter = Counter()
COUNTING = [False]


def wrap_syncs() -> None:
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if COUNTING[0]:
                COUNTS[_name] += 1
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)


def per_step(run_step, steps: int = 5) -> dict:
    run_step(0)  # the first step's one-off work (lazy state, compile) is not the steady state
    COUNTS.clear()
    COUNTING[0] = True
    try:
        for step in range(1, steps + 1):
            run_step(step)
    finally:
        COUNTING[0] = False
    return {name: count / steps for name, count in COUNTS.items()} | {"total": sum(COUNTS.values()) / steps}


def trial_step(tmp: Path, clip_mode: str, measure: bool):
    from llmlab.core.config import parse_config
    from llmlab.sweep.config import SweepConfig
    from llmlab.sweep.factors import CONTROL, resolve
    from llmlab.sweep.spec import Hparams, TrialSpec
    from llmlab.sweep.trial import build_setup, train_step

    hp = Hparams(
        **resolve(
            parse_config(SweepConfig, []),
            {**CONTROL, "lr": 1e-3, "batch_size": 4, "accumulation": 2, "clip_mode": clip_mode},
        )
    )
    spec = TrialSpec(
        trial_id="s",
        trial_dir=str(tmp),
        data_dir=str(tmp),
        hparams=hp,
        seed=42,
        steps=10,
        block_size=16,
        log_every=1,
        precheck_steps=2,
        timeout_s=600,
        eval_batches=1,
        eval_batch_size=4,
    )
    setup = build_setup(spec, hp, torch.device("cpu"))
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 50257, (4, 16)))
    return lambda step: train_step(setup, ids, ids, step, measure)


@dataclass
class Cfg:
    output_dir: str = ""
    overwrite_output_dir: bool = False
    resume_from_checkpoint: str = None
    report_to: list = field(default_factory=lambda: ["none"])
    seed: int = 42
    cpu_threads: int = 0


def trainer_step(tmp: Path):
    from llmlab.train.engine import GradClipper
    from llmlab.train.session import TrainingSession, scaled_schedule

    session = TrainingSession(
        Cfg(output_dir=str(tmp / "run")),
        "bench",
        run_files=("checkpoints",),
        resumable=(),
        mixed_precision="no",
        gradient_accumulation_steps=2,
    )
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
    model, optimizer = session.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    scheduler = scaled_schedule(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), session.state)
    clipper = GradClipper("1.0")
    session.register(scheduler, clipper)
    session.begin(Cfg(output_dir=str(tmp / "run")), 100, {}, save_every=1000, keep_last=1)
    x = torch.randn(4, 16)

    def step(_):
        for index in range(2):
            with session.accelerator.accumulate(model):
                session.backward(model(x).pow(2).mean(), tokens=4)
                if index == 1:
                    out = session.engine.step(model.parameters(), optimizer, scheduler, clipper, session.state.step)
                    session.record(out)

    return step


def main() -> int:
    import llmlab

    wrap_syncs()
    torch.set_num_threads(1)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        rows["trial, clip norm"] = per_step(trial_step(Path(tmp) / "a", "norm", False))
        rows["trial, clip value"] = per_step(trial_step(Path(tmp) / "b", "value", False))
        rows["trial, clip norm, measured step"] = per_step(trial_step(Path(tmp) / "c", "norm", True))
        rows["trainer (TrainingSession)"] = per_step(trainer_step(Path(tmp) / "d"))
    print(f"llmlab from {Path(llmlab.__file__).parent}; host syncs per optimizer step (2 micro-batches), CPU count")
    print(f"| step | total | {' | '.join(SYNCS)} |\n|---|---|{'---|' * len(SYNCS)}")
    for name, row in rows.items():
        print(f"| {name} | {row['total']:.0f} | " + " | ".join(f"{row.get(s, 0):.0f}" for s in SYNCS) + " |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
