"""The session both trainers build on: one `TrainingSession` owns what every run needs, so the trainers keep only
what is their own (pretraining: spike rollback; LoRA: prompt masking, early stopping, before/after eval).

    session = TrainingSession(cfg, "pretraining", run_files=RUN_FILES, resumable=RESUMABLE)  # folder, lock, trackers
    with session:                                            # Ctrl-C and errors end as one line
        model, optimizer, loader = session.prepare(model, optimizer, loader)
        session.register(scheduler, clipper)                 # saved and restored with every checkpoint
        session.begin(run_cfg, total_steps, layout, CheckpointGroup.of(cfg), LoggingGroup.of(cfg), model=model)
        validator = session.evaluator(EvalGroup.of(cfg), evaluate)   # an evaluation with its own cadence
        ... the trainer's loop (pretrain/loop.py, lora/loop.py):
            with accelerator.accumulate(model): session.backward(loss, tokens)
            session.record(session.engine.step(params, optimizer, scheduler, clipper, step))   # no host sync
            if session.collect_due():                        # asks the meter, the checkpointer, the evaluators
                results = session.collect()                  # the steps since the last collect, one host read
                session.meter.log_step(results[-1])          # when due: window, tokens/s, MFU (train/meter.py)
                session.checkpointer.maybe_save(step)        # when due (train/checkpointing.py)
                validator.maybe_run()                        # when due (train/evaluation.py)

What it owns: the Accelerator (train/accelerator.py), the run folder (lock, kind, fresh/resume/overwrite policy,
config.yaml + run_info.json), resume (a verified checkpoint, a config and setup that may only change where the
trainer allows it), the engine that runs the step (train/engine.py), rewinding to a checkpoint (rollback), the
trackers (TensorBoard/wandb/... plus metrics.jsonl), and the components that own their cadence, each built from
its config group: `StepMeter` (logging), `Checkpointer` (saves) and any `Evaluator` a trainer adds. Each says when
it is due; the session only asks them.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from torch.optim.lr_scheduler import LambdaLR

from llmlab.core.config import to_dict
from llmlab.core.device import set_cpu_threads
from llmlab.core.errors import Interrupted, UserError, write_failure
from llmlab.core.runfolder import abandon_claim, check_output_dir, claim_run_folder, record_claim, release_lock
from llmlab.core.runinfo import write_run_info
from llmlab.core.tracking import tracker_config
from llmlab.train import checkpointing as ckpt
from llmlab.train.accelerator import make_accelerator
from llmlab.train.checkpointing import Checkpointer
from llmlab.train.config import CheckpointGroup, EvalGroup, LoggingGroup, RunGroup
from llmlab.train.engine import AccelerateBackend, Engine, StepOutput
from llmlab.train.evaluation import Evaluator
from llmlab.train.meter import StepMeter

ALWAYS_RESUMABLE = (
    "output_dir",
    "resume_from_checkpoint",
    "overwrite_output_dir",
    "report_to",
    "cache_dir",
    "num_proc",
    "prepare_only",
    "cpu_threads",
)


@dataclass
class LoopState:
    """The counters an exact resume needs; registered with accelerate, so every checkpoint carries them."""

    step: int = 0  # optimizer steps done
    micro_batches: int = 0  # data position: micro-batches this process has consumed
    tokens_seen: int = 0
    lr_scale: float = 1.0  # the schedule's multiplier (pretraining lowers it at each rollback)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@dataclass
class StepResult:
    step: int  # the optimizer step it was (1-based)
    loss: float  # mean over this step's micro-batches and processes
    grad_norm: Optional[float]  # before clipping
    lr: float  # the lr this step used
    stepped: bool  # False when a non-finite loss or gradient kept the update off the weights


def scaled_schedule(scheduler, state: LoopState):
    """The same schedule (any transformers LambdaLR) times the run's current lr scale, read at every step:
    the public way to lower the lr mid-run (a rollback) without touching a scheduler's private state."""

    schedules = scheduler.lr_lambdas
    return LambdaLR(scheduler.optimizer, [lambda step, f=f: f(step) * state.lr_scale for f in schedules])


class TrainingSession:
    def __init__(
        self,
        cfg: RunGroup,
        kind: str,
        *,
        run_files: Iterable[str],
        resumable: Iterable[str],
        mixed_precision: Optional[str] = None,
        gradient_accumulation_plugin=None,
        gradient_accumulation_steps: int = 1,
    ):

        self.cfg, self.kind = cfg, kind
        self.out = check_output_dir(cfg.output_dir)  # a file or read-only folder fails here, before any setup
        self.run_files, self.resumable = tuple(run_files), set(resumable) | set(ALWAYS_RESUMABLE)
        self.resume_path, self.resumed_config = None, None
        if cfg.resume_from_checkpoint:  # fail fast, before the data and model are built
            self.resume_path = ckpt.resolve_checkpoint(self.out, cfg.resume_from_checkpoint)
        self.accelerator = make_accelerator(
            cfg, mixed_precision, gradient_accumulation_plugin, gradient_accumulation_steps, self.out
        )
        if self.accelerator.device.type == "cpu":
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.accelerator.num_processes))
            set_cpu_threads(cfg.cpu_threads, local, self.accelerator.print)
        self.state, self.meter, self.checkpointer, self._claimed = LoopState(), None, None, False
        self.evaluators: list[Evaluator] = []
        self.engine = Engine(AccelerateBackend(self.accelerator))
        self._micro_tokens = 0
        self._pending: list[tuple[int, StepOutput, int]] = []  # (step, outcome on the device, local tokens)
        self._claim()

    # ------------------------------------------------------------------ setup
    def _claim(self) -> None:

        if self.accelerator.is_main_process:  # the owner and kind records wait until begin() accepted the run
            claim_run_folder(
                self.out,
                self.run_files,
                resume=self.resume_path is not None,
                overwrite=self.cfg.overwrite_output_dir,
                what=self.kind,
                record=False,
            )
            self._claimed = True
        self.accelerator.wait_for_everyone()

    def prepare(self, *objects):
        try:
            return self.accelerator.prepare(*objects)
        except ValueError as err:  # DeepSpeed refuses a precision the device lacks
            raise UserError(
                f"cannot prepare the model for this device ({str(err).splitlines()[0][:160]}); "
                "on CPU use --mixed_precision bf16 or no"
            ) from None

    def register(self, *objects) -> None:
        """Objects with state_dict/load_state_dict that every checkpoint saves and restores (order matters)."""
        for obj in (self.state, *objects):
            self.accelerator.register_for_checkpointing(obj)

    def begin(
        self,
        run_cfg,
        total_steps: int,
        layout: dict,
        checkpoint: CheckpointGroup,
        logging: LoggingGroup = LoggingGroup(),
        model=None,
        desc: Optional[str] = None,
        extra_manifest=None,
        write_extra=None,
    ) -> Optional[dict]:
        """Take the run's resolved config (its defaults that needed the data filled in), write the run record, start
        the trackers, resume if asked; returns the checkpoint manifest if resumed."""
        self.cfg, self.layout, self.total_steps = run_cfg, layout, total_steps
        saved = self._check_resume() if self.resume_path is not None else None  # refusals first: nothing written yet
        if self.accelerator.is_main_process:
            note = record_claim(self.out, self.kind)
            if note:
                self.accelerator.print(note)
            ckpt.remove_partial_saves(self.out)
            write_run_info(self.out, self.cfg)
        self.accelerator.init_trackers(f"llmlab-{self.kind}", config=tracker_config(to_dict(self.cfg)))
        self.checkpointer = Checkpointer(self, checkpoint, model, extra_manifest, write_extra)
        manifest = self._resume(saved) if saved is not None else None
        self.meter = StepMeter(
            self.state,
            self.log,
            total_steps,
            desc or self.kind,
            show_bar=self.accelerator.is_local_main_process,
            num_processes=self.accelerator.num_processes,
            logging=logging,
        )
        return manifest

    def evaluator(self, group: EvalGroup, run, enabled: bool = True) -> Evaluator:
        """An evaluation with its own cadence (train/evaluation.py), which `collect_due` asks from now on."""
        evaluator = Evaluator(self, group, run, enabled)
        self.evaluators.append(evaluator)
        return evaluator

    def _check_resume(self) -> dict:
        """Every reason to refuse this resume, checked before anything on disk is written or moved."""
        path = self.resume_path
        saved = ckpt.read_trainer_state(path)
        ckpt.check_layout(saved.get("layout", {}), self.layout, path, self.layout_hint)
        saved["changed"] = ckpt.check_resume_config(saved.get("config", {}), to_dict(self.cfg), self.resumable, path)
        if saved["step"] > self.total_steps:
            raise UserError(
                f"checkpoint {path} is at step {saved['step']}, past the {self.total_steps} steps this run "
                "would train; pass a larger --max_steps (or --epochs) to continue it"
            )
        return saved

    def _resume(self, saved: dict) -> dict:
        path, changed = self.resume_path, saved.pop("changed")
        if self.accelerator.is_main_process:
            moved = ckpt.set_aside_newer_checkpoints(self.out, path)
            if moved:
                self.accelerator.print(
                    f"note: resuming from {path.name}, an older checkpoint: "
                    f"{', '.join(p.name for p in moved)} set aside (renamed, not deleted)"
                )
        ckpt.load_checkpoint(self.accelerator, path)
        self.resumed_config = dict(saved.get("config", {}))
        changed = sorted(set(changed) - set(ALWAYS_RESUMABLE))  # a new folder or tracker is not a training change
        if changed:
            self.accelerator.print(f"resume: honouring changed option(s) {', '.join(changed)}")
        self.accelerator.print(f"resumed from {path} at step {self.state.step}")
        return saved

    layout_hint = "batch size, block size, processes and data"

    # ------------------------------------------------------------------ the step
    def backward(self, loss: torch.Tensor, tokens: int) -> None:
        self.engine.backward(loss)
        self._micro_tokens += tokens
        self.state.micro_batches += 1

    def record(self, out: StepOutput) -> None:
        """After the engine's step (which never applies a non-finite update: it reports it as the step's loss, so
        the trainer can react): count it, and keep its values where they are until `collect` reads them."""
        self.state.step += 1
        self._pending.append((self.state.step, out, self._micro_tokens))
        self._micro_tokens = 0
        self.meter.tick()

    def collect_due(self) -> bool:
        """Whether this step must read its values back, asked of the components that own a cadence: a log or an
        evaluation is due (the meter, each evaluator: the last step is always one), or a save (a checkpoint holds
        the token count and the spike detector's state)."""
        step = self.state.step
        return any(part.due(step) for part in (self.meter, self.checkpointer, *self.evaluators))

    def collect(self) -> list[StepResult]:
        """Every step recorded since the last collect, each loss and token count summed over the processes in one
        reduce and read back in one host sync (OLMo-core's metrics collect interval): between collects a GPU runs
        ahead of the host. The meter's window gets each step."""
        if not self._pending:
            return []
        device = self.accelerator.device
        steps, outs, tokens = zip(*self._pending)
        self._pending = []
        flags = torch.stack([out.flags().to(device) for out in outs])  # loss sum, norm, stepped, clipped, overflow
        micro = torch.tensor([len(out.losses) for out in outs], dtype=torch.float64, device=device)
        summed = torch.stack([flags[:, 0], micro, torch.tensor(tokens, dtype=torch.float64, device=device)], 1)
        summed = self.accelerator.reduce(summed, reduction="sum")  # the norm and flags are the same on every process
        results = []
        rows = torch.cat([summed, flags[:, 1:3]], 1).tolist()  # the one host sync
        for step, out, (loss_sum, micro, tokens, norm, stepped) in zip(steps, outs, rows):
            self.state.tokens_seen += int(tokens)
            self.meter.add(loss_sum, micro, tokens)
            grad_norm = None if out.grad_norm is None else norm
            results.append(StepResult(step, loss_sum / micro, grad_norm, out.lr, bool(stepped)))
        return results

    def refresh_lr(self, scheduler, learning_rate: Optional[float] = None) -> None:
        """Apply the schedule's current factor now (after a rollback or a resume), through LambdaLR's public
        attributes: the next step already uses it. A resume with a changed --learning_rate scales every group's
        base lr by new / saved, so each group keeps its own multiplier (Lion's lr / 3)."""
        saved = (self.resumed_config or {}).get("learning_rate")
        if learning_rate is not None and saved and learning_rate != saved:
            scheduler.base_lrs = [base * learning_rate / saved for base in scheduler.base_lrs]
            self.resumed_config["learning_rate"] = learning_rate  # once: later checkpoints carry the new bases
        for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * factor(scheduler.last_epoch)

    def rewind(self, path: Path, scheduler, learning_rate: float, lr_factor: float, skip_to: Optional[int]) -> int:
        """Back to checkpoint `path` (a rollback): its state, the lr scale x `lr_factor`, and the data position moved
        on to `skip_to` micro-batches if given (the batches since the checkpoint up to there are skipped). Returns
        how many micro-batches that skips."""
        state = self.state
        scale = state.lr_scale * lr_factor
        self._pending = []  # steps not yet collected are undone with the rest
        ckpt.load_checkpoint(self.accelerator, path)
        skipped = skip_to - state.micro_batches if skip_to is not None else 0
        state.lr_scale = scale
        if skip_to is not None:
            state.micro_batches = skip_to
        self.refresh_lr(scheduler, learning_rate)
        self.meter.discard_window()  # the spike's steps and the reload are not training throughput
        return skipped

    # ------------------------------------------------------------------ logging (the cadence: train/meter.py)
    def log(self, values: dict[str, Any], step: Optional[int] = None) -> None:
        self.accelerator.log(
            {k: v for k, v in values.items() if v is not None}, step=self.state.step if step is None else step
        )

    # ------------------------------------------------------------------ the end
    def __enter__(self) -> "TrainingSession":
        return self

    def __exit__(self, kind, error, trace) -> bool:
        if self.meter is not None:
            self.meter.close()  # first, so an error message starts on its own line
        self.accelerator.end_training()
        if self._claimed:
            # a run refused before begin() recorded its claim leaves no trace; any other end marks the lock released
            abandon_claim(self.out) if self.checkpointer is None else release_lock(self.out)
        if kind is KeyboardInterrupt:
            last = ckpt.latest_checkpoint(self.out)
            if last is not None:
                raise Interrupted(
                    f"at step {self.state.step}; the last checkpoint is {last}: rerun with "
                    "--resume_from_checkpoint latest to continue from it"
                ) from None
            raise Interrupted(
                f"at step {self.state.step}, before the first checkpoint: nothing to resume; rerun with "
                "--overwrite_output_dir to start again"
            ) from None

        if error is not None and not isinstance(error, UserError) and write_failure(error):
            raise ckpt.write_error(error, f"the run's files in {self.out}") from None
        return False
