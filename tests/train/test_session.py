"""TrainingSession and Checkpointer on their own (in-process, a real accelerate, a two-parameter model): the
optimizer step's guards, clipping modes, the checkpoint cadence, resume refusals, rewind, and the run record."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import torch

from llmlab.core.errors import UserError
from llmlab.train.config import CheckpointGroup, RunGroup
from llmlab.train.engine import GradClipper
from llmlab.train.session import LoopState, TrainingSession, scaled_schedule


@dataclass
class Cfg(RunGroup):
    learning_rate: float = 0.1
    report_to: list = field(default_factory=lambda: ["none"])


@pytest.fixture()
def fresh_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def make(tmp_path, **kwargs):
    cfg = Cfg(output_dir=str(tmp_path / "run"), **kwargs)
    session = TrainingSession(
        cfg, "unit", run_files=("checkpoints", "config.yaml"), resumable=("learning_rate",), mixed_precision="no"
    )
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.learning_rate)
    model, optimizer = session.prepare(model, optimizer)
    scheduler = scaled_schedule(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), session.state)
    clipper = GradClipper("0.5")
    session.register(scheduler, clipper)
    return cfg, session, model, optimizer, scheduler, clipper


def step(session, model, optimizer, scheduler, clipper, x):
    loss = model(torch.tensor(x)).sum()
    session.backward(loss, tokens=1)
    session.record(session.engine.step(model.parameters(), optimizer, scheduler, clipper, session.state.step))
    return session.collect()[-1]


def test_optimizer_step_clips_and_never_applies_a_non_finite_update(tmp_path, fresh_state):
    cfg, session, model, optimizer, scheduler, clipper = make(tmp_path)
    with session:
        session.begin(cfg, 10, {"layout": 1}, CheckpointGroup(save_every=100, keep_last=1))
        before = model.weight.detach().clone()
        result = step(session, model, optimizer, scheduler, clipper, [[3.0, 4.0]])  # gradient (3, 4): norm 5
        assert result.stepped and result.grad_norm == pytest.approx(5.0)
        assert torch.allclose(before - model.weight.detach(), 0.1 * torch.tensor([[0.3, 0.4]]))  # clipped to 0.5
        frozen = model.weight.detach().clone()
        result = step(session, model, optimizer, scheduler, clipper, [[math.nan, 1.0]])
        assert not result.stepped and torch.equal(model.weight.detach(), frozen)  # the NaN never reached it
        assert session.state.step == 2  # counted, and the schedule moved on


@contextmanager
def host_reads():
    """Counts the Tensor methods that read a value back to the host (each one a wait for a GPU)."""
    counted, originals = [], {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name):
        def read(self, *args, **kwargs):
            counted.append(name)
            return originals[name](self, *args, **kwargs)

        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield counted
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__")


def test_a_fused_optimizer_skips_a_non_finite_step_on_the_device_and_the_step_reads_nothing_back(tmp_path, fresh_state):
    """With fused AdamW the finite guard is the kernel's (GradScaler's found_inf): a NaN step leaves the weights and
    the optimizer state as they were, and neither the steps nor the skip read a value back until `collect`, which
    reads all of them at once."""
    cfg = Cfg(output_dir=str(tmp_path / "run"))
    session = TrainingSession(cfg, "unit", run_files=("checkpoints", "config.yaml"), resumable=(), mixed_precision="no")
    model = torch.nn.Linear(2, 1, bias=False)
    model, optimizer = session.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=True))
    scheduler = scaled_schedule(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), session.state)
    clipper = GradClipper("0.5")
    with session:
        session.begin(cfg, 10, {}, CheckpointGroup(save_every=100, keep_last=1))

        def one_step(x):
            session.backward(model(torch.tensor(x)).sum(), tokens=1)
            session.record(session.engine.step(model.parameters(), optimizer, scheduler, clipper, session.state.step))

        with host_reads() as counted:
            one_step([[3.0, 4.0]])
            weight = model.weight.detach().clone()
            state = {name: value.clone() for name, value in optimizer.state[model.weight].items()}
            one_step([[math.nan, 1.0]])
        assert counted == []  # two steps, a clip and a skip: nothing read back
        with host_reads() as counted:
            first, second = session.collect()
        assert len(counted) == 1  # one read for both steps
    assert first.stepped and first.grad_norm == pytest.approx(5.0) and (first.step, second.step) == (1, 2)
    assert not second.stepped and math.isnan(second.loss)
    assert torch.equal(model.weight.detach(), weight)  # the NaN never reached the weights
    assert all(torch.equal(optimizer.state[model.weight][k], v) for k, v in state.items())  # nor the moments, step
    assert not hasattr(optimizer.optimizer, "found_inf")  # the guard is taken off after the step


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adamw"])
def test_fp16_overflow_goes_to_the_loss_scaler_and_the_next_step_runs(tmp_path, fresh_state, monkeypatch, fused):
    """The GPU smoke's fp16 failure, on CPU: accelerate's own fp16 path (backward scales, clipping unscales, the
    wrapped optimizer's step skips an overflow and lowers the scale), with torch's CPU GradScaler standing in for
    the CUDA one. An overflowed first step is the scaler's to skip; skipping its step ourselves broke the next one.
    SGD's skip is decided on the host; fused AdamW's inside its kernel, which the host never sees."""
    cfg = Cfg(output_dir=str(tmp_path / "run"))
    session = TrainingSession(
        cfg, "unit", run_files=("checkpoints", "config.yaml"), resumable=(), mixed_precision="no"
    )  # fp16 is refused on CPU: set up its scaler path by hand
    monkeypatch.setattr(type(session.accelerator), "mixed_precision", property(lambda self: "fp16"))
    session.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**126)  # 4 x 2^126 overflows fp32
    session.accelerator.native_amp = True
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer = (
        torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=0.0, fused=True)
        if fused
        else torch.optim.SGD(model.parameters(), lr=cfg.learning_rate)
    )
    model, optimizer = session.prepare(model, optimizer)
    scheduler = scaled_schedule(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), session.state)
    clipper = GradClipper("0.5")
    with session:
        session.begin(cfg, 10, {}, CheckpointGroup(save_every=100, keep_last=1))
        before = model.weight.detach().clone()
        result = step(session, model, optimizer, scheduler, clipper, [[3.0, 4.0]])
        assert not result.stepped and math.isfinite(result.loss) and torch.equal(model.weight.detach(), before)
        assert session.accelerator.scaler.get_scale() == 2.0**125  # the scaler saw the overflow
        result = step(session, model, optimizer, scheduler, clipper, [[3.0, 4.0]])  # 4 x 2^125 fits
        assert result.stepped and result.grad_norm == pytest.approx(5.0)
        moved = before - model.weight.detach()
        # SGD: lr x the clipped gradient; AdamW's first update: lr x its sign (m / sqrt(v) = g / |g|)
        assert torch.allclose(moved, 0.1 * (torch.ones(1, 2) if fused else torch.tensor([[0.3, 0.4]])), atol=1e-6)


def test_value_clipping_clamps_each_element(tmp_path, fresh_state):
    cfg, session, model, optimizer, scheduler, _ = make(tmp_path)
    with session:
        session.begin(cfg, 10, {}, CheckpointGroup(save_every=100, keep_last=1))
        before = model.weight.detach().clone()
        step(session, model, optimizer, scheduler, GradClipper("0.5", clip_mode="value"), [[3.0, 0.2]])
        assert torch.allclose(before - model.weight.detach(), 0.1 * torch.tensor([[0.5, 0.2]]))


def test_checkpointer_owns_the_cadence_and_waits_when_not_allowed(tmp_path, fresh_state):
    cfg, session, model, optimizer, scheduler, clipper = make(tmp_path)
    with session:
        session.begin(cfg, 10, {"layout": 1}, CheckpointGroup(save_every=2, keep_last=2), model=model)
        saved = []
        for _ in range(6):
            step(session, model, optimizer, scheduler, clipper, [[1.0, 1.0]])
            allowed = session.state.step != 2  # e.g. mid-spike at step 2: the save waits for the next step
            saved.append(session.checkpointer.maybe_save(session.state.step, allowed=allowed))
    names = [p.name if p else None for p in saved]
    assert names == [None, None, "step_3", "step_4", None, "step_6"]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_4", "step_6"]  # keep_last 2
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "step_6" / "trainer_state.json").read_text())
    assert manifest["step"] == 6 and manifest["layout"] == {"layout": 1} and manifest["config"]["learning_rate"] == 0.1


def test_resume_restores_state_and_refuses_other_setups_before_writing(tmp_path, fresh_state):
    cfg, session, model, optimizer, scheduler, clipper = make(tmp_path)
    with session:
        session.begin(cfg, 10, {"layout": 1}, CheckpointGroup(save_every=2, keep_last=3), model=model)
        for _ in range(2):
            step(session, model, optimizer, scheduler, clipper, [[1.0, 2.0]])
        session.checkpointer.maybe_save(2)
        weights = model.weight.detach().clone()
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    cfg2, session2, model2, *rest = make(tmp_path, resume_from_checkpoint="latest", learning_rate=0.05)
    with session2:
        session2.begin(cfg2, 10, {"layout": 1}, CheckpointGroup(save_every=2, keep_last=3), model=model2)
        assert session2.state.step == 2 and torch.equal(model2.weight.detach(), weights)
    AcceleratorState._reset_state(True)
    cfg3, session3, model3, *rest = make(tmp_path, resume_from_checkpoint="latest")
    record = (tmp_path / "run" / "run_info.json").stat().st_mtime_ns
    with pytest.raises(UserError, match="written with another setup"):
        with session3:
            session3.begin(cfg3, 10, {"layout": 2}, CheckpointGroup(save_every=2, keep_last=3), model=model3)
    assert (tmp_path / "run" / "run_info.json").stat().st_mtime_ns == record  # refused before writing


def test_rewind_restores_a_checkpoint_with_a_lower_lr_and_skips_the_data(tmp_path, fresh_state):
    cfg, session, model, optimizer, scheduler, clipper = make(tmp_path)
    with session:
        session.begin(cfg, 10, {}, CheckpointGroup(save_every=2, keep_last=3), model=model)
        for _ in range(2):
            step(session, model, optimizer, scheduler, clipper, [[1.0, 1.0]])
        path = session.checkpointer.maybe_save(2)
        at_checkpoint = model.weight.detach().clone()
        for _ in range(3):
            step(session, model, optimizer, scheduler, clipper, [[1.0, 1.0]])
        skipped = session.rewind(path, scheduler, cfg.learning_rate, lr_factor=0.5, skip_to=5)
        assert skipped == 3 and session.state.step == 2 and session.state.micro_batches == 5
        assert torch.equal(model.weight.detach(), at_checkpoint)
        assert session.state.lr_scale == 0.5 and optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_state_round_trips():
    state = LoopState(step=3, micro_batches=7, tokens_seen=11, lr_scale=0.25)
    copy = LoopState()
    copy.load_state_dict(state.state_dict())
    assert copy == state


def test_each_component_owns_its_cadence_and_the_session_only_asks(tmp_path, fresh_state):
    """The meter logs every log_every steps, the checkpointer saves every save_every, an evaluator runs every
    eval_every, each also at the last step (but saves); `collect_due` is true exactly where one of them is due."""
    from llmlab.train.config import EvalGroup, LoggingGroup

    cfg, session, model, optimizer, scheduler, clipper = make(tmp_path)
    with session:
        session.begin(cfg, 7, {}, CheckpointGroup(save_every=4, keep_last=1), LoggingGroup(log_every=5), model=model)
        runs, never = [], []
        evaluator = session.evaluator(EvalGroup(eval_every=3), lambda: runs.append(session.state.step) or "ran")
        session.evaluator(EvalGroup(eval_every=1), lambda: never.append(1), enabled=False)
        due = []
        for _ in range(7):
            session.backward(model(torch.tensor([[1.0, 1.0]])).sum(), tokens=1)
            session.record(session.engine.step(model.parameters(), optimizer, scheduler, clipper, session.state.step))
            if session.collect_due():
                due.append(session.state.step)
                session.collect()
            assert evaluator.maybe_run() == ("ran" if session.state.step in (3, 6, 7) else None)
    assert runs == [3, 6, 7] and never == []
    assert due == [3, 4, 5, 6, 7]  # evaluator 3, 6; checkpointer 4; meter 5; the last step 7
