"""Host syncs per optimizer step: how often the step reads a tensor's value back to Python (item, float, int, bool,
tolist), each one a wait for the device on a GPU. Counted on CPU by wrapping those Tensor methods, for a sweep
trial's step and train_pretrain.py's loop (2 micro-batches, logging every 5th step), in whichever llmlab is on
PYTHONPATH:

    python bench/host_syncs.py                                  # this tree
    git worktree add /tmp/before efd5278 && PYTHONPATH=/tmp/before python bench/host_syncs.py   # before the cuts
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch

if importlib.util.find_spec("llmlab") is None:  # PYTHONPATH picks the tree to count; else this one
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SYNCS = ("item", "__float__", "__int__", "__bool__", "tolist")
COUNTS: Counter = Counter()
COUNTING = [False]
CHARGE = [None]  # while the trainer runs: charges each sync to the step the run is at


def wrap_syncs() -> None:
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if COUNTING[0]:
                COUNTS[_name] += 1
            if CHARGE[0] is not None:
                CHARGE[0](_name)
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


def pretrain_steps(tmp: Path, steps: int, log_every: int, accumulation: int) -> dict:
    """The real train_pretrain.py loop in this process (a 1-layer GPT-2 on the built-in Wikipedia sample, fused
    AdamW, clipping at 1.0), its syncs counted per optimizer step. A sync is charged to the step the run's counter
    shows when it happens: step k's charge is what ran after step k was recorded (collecting, logging, evaluating,
    saving) and step k+1's forward, backward and engine step, so a step that reads nothing back is charged 0."""
    from llmlab.core.config import parse_config
    from llmlab.train import session as session_module
    from llmlab.train.pretrain.loop import PretrainConfig, train

    per_step: Counter = Counter()
    collected: set[int] = set()
    state = {}
    begin, collect = session_module.TrainingSession.begin, getattr(session_module.TrainingSession, "collect", None)

    def begin_and_watch(self, *args, **kwargs):
        state["loop"] = self.state
        return begin(self, *args, **kwargs)

    def collect_and_mark(self):
        collected.add(self.state.step)
        return collect(self)

    def charge(name: str) -> None:
        if "loop" in state:
            per_step[state["loop"].step] += 1

    session_module.TrainingSession.begin = begin_and_watch
    if collect is not None:  # a tree before the collect reads every step
        session_module.TrainingSession.collect = collect_and_mark
    args = ["--output_dir", str(tmp / "run"), "--cache_dir", str(tmp / "cache"), "--max_steps", str(steps)]
    args += ["--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--block_size", "32", "--batch_size", "2"]
    args += ["--effective_batch_size", str(2 * accumulation), "--max_documents", "40", "--log_every", str(log_every)]
    args += ["--eval_every", str(10 * steps), "--save_every", str(10 * steps), "--sample_tokens", "0"]
    args += ["--report_to", "none"]
    CHARGE[0] = charge
    try:
        train(parse_config(PretrainConfig, args))
    finally:
        CHARGE[0] = None
        session_module.TrainingSession.begin = begin
        if collect is not None:
            session_module.TrainingSession.collect = collect
    inner = range(1, steps - 1)  # step 0's charge holds the first step's one-off work; the last step evaluates
    quiet = [per_step[k] for k in inner if k not in collected and k % log_every]
    reading = [per_step[k] for k in inner if k in collected or k % log_every == 0]
    return {
        "other steps": float(np.median(quiet)) if quiet else None,
        "log steps": float(np.median(reading)) if reading else None,
        "steps": len(quiet) + len(reading),
    }


def main() -> int:
    import llmlab

    wrap_syncs()
    torch.set_num_threads(1)
    rows, trainer = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        rows["trial, clip norm"] = per_step(trial_step(Path(tmp) / "a", "norm", False))
        rows["trial, clip value"] = per_step(trial_step(Path(tmp) / "b", "value", False))
        rows["trial, clip norm, measured step"] = per_step(trial_step(Path(tmp) / "c", "norm", True))
        trainer = pretrain_steps(Path(tmp) / "d", steps=24, log_every=5, accumulation=2)
    print(f"llmlab from {Path(llmlab.__file__).parent}; host syncs per optimizer step (2 micro-batches), CPU count")
    print(f"| a sweep trial's step | total | {' | '.join(SYNCS)} |\n|---|---|{'---|' * len(SYNCS)}")
    for name, row in rows.items():
        print(f"| {name} | {row['total']:.0f} | " + " | ".join(f"{row.get(s, 0):.0f}" for s in SYNCS) + " |")
    print("\n| train_pretrain.py, every 5th step logs (median per step) | steps that log | other steps |")
    print(
        f"|---|---|---|\n| {trainer['steps']} steps, fused AdamW, clip 1.0 | {trainer['log steps']:.0f} | "
        f"{trainer['other steps']:.0f} |"
    )
    rows["train_pretrain.py"] = trainer
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
