"""GPT-2 pretraining with accelerate (optionally DeepSpeed ZeRO-2): the training loop behind train_pretrain.py.

One readable loop in `train()`: gradient accumulation through `accelerator.accumulate`, mixed precision
and DeepSpeed through `accelerate launch`, the shared optimizer/schedule factory (AdamW + cosine with warmup and a
floor by default), checkpoints that resume exactly, and loss-spike rollback (PaLM-style: reload the last
checkpoint, lower the lr, skip the data that caused the spike). The options live in llmlab.train.pretrain.config.
"""

from __future__ import annotations

import math
import os
import time
from typing import Optional

import torch
from accelerate.utils import set_seed

from llmlab.core.errors import UserError
from llmlab.core.io import append_jsonl
from llmlab.data.prepare import prepare_dataset
from llmlab.data.tokenizer import load_tokenizer
from llmlab.infer.downstream import check_tasks, evaluate_tasks, score_lines
from llmlab.models.flops import current_device_name, flops_per_token, peak_flops
from llmlab.models.mup import width_mult
from llmlab.train import checkpointing as ckpt
from llmlab.train.accelerator import resolve_mixed_precision
from llmlab.train.batches import batch_stream, make_dataloaders
from llmlab.train.config import CheckpointGroup, EvalGroup, LoggingGroup
from llmlab.train.engine import GradClipper, innermost
from llmlab.train.evaluation import validation_loss
from llmlab.train.loss import CausalLMWithLoss, perplexity
from llmlab.train.pretrain import setup
from llmlab.train.pretrain.config import RESUMABLE, RUN_FILES, PretrainConfig
from llmlab.train.session import TrainingSession
from llmlab.train.spikes import RollbackState, SpikeDetector, parse_inject_spike

__all__ = ["PretrainConfig", "train", "Pretraining"]


def train(cfg: PretrainConfig) -> dict:
    """Pretrain per `cfg`: the loop, one optimizer step per iteration, read top to bottom (nanoGPT's). Returns a
    summary (steps, last validation loss, rollbacks, paths)."""
    # long: the loop is one piece on purpose: from the batches to the engine's step to every cadence, in order
    world = int(os.environ.get("WORLD_SIZE", "1"))  # the launch's processes: accumulation is known before setup
    if cfg.eval_tasks:  # a task name or its data that cannot work is found now, not after the training
        check_tasks(cfg.eval_tasks)
    session = TrainingSession(
        cfg,
        "pretraining",
        run_files=RUN_FILES,
        resumable=RESUMABLE,
        mixed_precision=resolve_mixed_precision(cfg.mixed_precision),
        gradient_accumulation_plugin=setup.accumulation_plugin(setup.accumulation_steps(cfg, world)),
    )
    setup.check_deepspeed(session.accelerator, cfg)
    with session:
        set_seed(cfg.seed)
        tokenizer = load_tokenizer(cfg.tokenizer)
        with session.accelerator.main_process_first():
            data = prepare_dataset(cfg.data_config(), tokenizer)
        cfg = cfg.for_data(len(data.train))  # the config this run uses: --max_steps defaults to one pass over the data
        run = Pretraining(cfg, session, tokenizer, data)
        acc, state, meter = session.accelerator, session.state, session.meter
        run.batches = batch_stream(acc, run.train_dl, state.micro_batches)  # a rollback restarts it
        micro_batches, last_loss = acc.gradient_accumulation_steps, None
        # resumed: its checkpoint was saved before that step's evaluations, which a run killed in between never ran
        last_val = run.evaluations() if 0 < state.step < cfg.max_steps else None
        run.model.train()
        while state.step < cfg.max_steps:
            drill_factor = run.drill_factor(state.step + 1)
            for index in range(micro_batches):
                waiting = time.perf_counter()
                input_ids = next(run.batches)["input_ids"]
                meter.waited(time.perf_counter() - waiting)
                with acc.accumulate(run.model):
                    loss = run.model(input_ids)  # the chunked head + cross-entropy (llmlab.train.loss)
                    session.backward(loss * drill_factor, input_ids.numel())
                    if index == micro_batches - 1:  # accelerate syncs (and the optimizer steps) on the last one
                        assert acc.sync_gradients, "accelerate did not sync on the step's last micro-batch"
                        out = session.engine.step(
                            run.model.parameters(), run.optimizer, run.scheduler, run.clipper, state.step
                        )
            session.record(out)  # the step's values stay on the device: no host sync until a cadence needs them
            if not session.collect_due():  # the meter, the checkpointer and the evaluators each own their cadence
                continue
            results = session.collect()  # every step since the last collect, in one host read
            spike = run.detector.first_spike([result.loss for result in results])
            if spike is not None:
                run.rollback(results[spike])
                continue
            last_loss = results[-1].loss
            meter.log_step(results[-1], {"train/loss_scale": setup.loss_scale(acc, run.optimizer)})
            # the step's checkpoint first: an evaluation that fails never costs the training before it
            session.checkpointer.maybe_save(state.step, allowed=run.detector.streak == 0)  # never mid-spike
            val = run.evaluations()
            last_val = val if val is not None else last_val
        return run.finish(last_val, last_loss)


class Pretraining:
    """The pretraining run on top of the shared session: data, GPT-2, optimizer + schedule, and spike rollback."""

    def __init__(self, cfg: PretrainConfig, session: TrainingSession, tokenizer, data):
        self.cfg, self.session, self.tokenizer, acc = cfg, session, tokenizer, session.accelerator
        model = CausalLMWithLoss(
            setup.build_pretrain_model(cfg, self.tokenizer), cfg.label_smoothing, cfg.loss_chunk_tokens
        )
        setup.use_tf32(cfg.tf32)
        self.compiled = setup.compile_wanted(cfg, session.accelerator.device)
        if self.compiled:  # the body only, in place (state-dict keys unchanged); the chunked loss stays eager
            model.model.base_model.compile()
        train_dl, self.val_dl = make_dataloaders(cfg, data)
        # validation stays unsharded (train/evaluation.validation_loss): the same tokens at any world size
        self.model, self.optimizer, self.train_dl = session.prepare(model, setup.build_optimizer(cfg, model), train_dl)
        self.scheduler = setup.make_scheduler(cfg, self.optimizer, session.state)
        self.clipper = GradClipper(cfg.clip, warmup_steps=cfg.warmup_steps, clip_mode=cfg.clip_mode)
        self.detector = SpikeDetector(cfg.spike_factor, cfg.spike_window, cfg.spike_patience, cfg.spike_arm_steps)
        self.rollbacks = RollbackState()
        self.drill = parse_inject_spike(cfg.inject_spike)
        self.scored_at, self.last_scores = None, None  # the step --eval_tasks last scored, and its scores
        session.register(self.scheduler, self.clipper, self.detector, self.rollbacks)
        setup.check_data_size(self.train_dl, acc)
        layout = {
            "batch_size": cfg.batch_size,
            "block_size": cfg.block_size,
            "num_processes": acc.num_processes,
            "gradient_accumulation_steps": acc.gradient_accumulation_steps,
            "train_batches": len(self.train_dl),
            "data": data.cache_path.name,
        }  # names the data's content and preparation: a resume checks it
        session.begin(
            cfg,
            cfg.max_steps,
            layout,
            CheckpointGroup.of(cfg),
            LoggingGroup.of(cfg),
            model=self.model,
            desc="pretrain",
            extra_manifest=lambda: self.rollbacks.state_dict(),
        )
        session.refresh_lr(self.scheduler, cfg.learning_rate)  # a resume honours a changed --learning_rate
        # the evaluations, each with its own cadence (every --eval_every / --eval_tasks_every steps, and the last)
        self.validator = session.evaluator(EvalGroup.of(cfg), self.evaluate, enabled=len(self.val_dl) > 0)
        tasks = EvalGroup(eval_every=cfg.eval_tasks_every)
        self.task_scorer = session.evaluator(
            tasks, lambda: self.downstream(periodic=True), enabled=bool(cfg.eval_tasks and cfg.eval_tasks_every)
        )
        self.describe()

    def describe(self) -> None:
        cfg, acc, session = self.cfg, self.session.accelerator, self.session
        unwrapped = acc.unwrap_model(self.model).model
        mup = (
            f", muP (base width {cfg.mup_base_width}, m = {width_mult(unwrapped):g})"
            if cfg.parametrization == "mup"
            else ""
        )
        acc.print(
            f"model {cfg.init_from or cfg.model}: {unwrapped.num_parameters() / 1e6:.1f}M params{mup}; "
            f"{cfg.max_steps} steps of {cfg.effective_batch_size} x {cfg.block_size} tokens "
            f"({cfg.batch_size}/device x {acc.gradient_accumulation_steps} accumulation x {acc.num_processes} "
            f"processes); precision {acc.mixed_precision}{', compiled' if self.compiled else ''}; optimizer "
            f"{type(innermost(self.optimizer)).__name__}, {cfg.lr_scheduler} schedule; "
            f"{acc.distributed_type.value}"
        )
        session.meter.flops_per_token = flops_per_token(unwrapped, cfg.block_size)
        session.meter.peak_flops = peak_flops(current_device_name(), acc.mixed_precision)

    def finish(self, last_val: Optional[float], last_loss: Optional[float]) -> dict:
        """Measure (if the loop did not just), refuse a non-finite model, save it, score the tasks, sample."""
        cfg, session, acc, state = self.cfg, self.session, self.session.accelerator, self.session.state
        if last_val is None and len(self.val_dl):  # e.g. resumed at the last step: measure before publishing
            with session.meter.paused():
                last_val = self.evaluate()
        final_loss = last_val if last_val is not None else last_loss
        if final_loss is not None and not math.isfinite(final_loss):
            raise UserError(
                f"the run ended with loss {final_loss}: not publishing a broken model; lower "
                "--learning_rate and resume from the last good checkpoint"
            )
        with session.meter.paused():
            final_dir = setup.save_final(acc, self.model, self.tokenizer, session.out)
            downstream = self.downstream() if cfg.eval_tasks and self.scored_at != state.step else self.last_scores
        return {
            "samples": self.final_samples(),
            "step": state.step,
            "val_loss": last_val,
            "rollbacks": self.rollbacks.rollbacks,
            "final_dir": str(final_dir),
            "downstream": downstream,
            "output_dir": str(session.out),
        }

    def drill_factor(self, step: int) -> float:
        """--inject_spike: multiply the loss of `spike_patience` steps from STEP, once."""
        if (
            not self.drill
            or self.rollbacks.drill_done
            or not self.drill[0] <= step < self.drill[0] + self.cfg.spike_patience
        ):
            return 1.0
        self.rollbacks.drill_done = step == self.drill[0] + self.cfg.spike_patience - 1
        return self.drill[1]

    def downstream(self, periodic: bool = False) -> Optional[dict]:
        """--eval_tasks through lm-evaluation-harness on the live model (the main process scores, the others wait).
        A periodic evaluation that fails is an event and a warning, and training goes on; the final one's failure
        ends the run (its final/ is saved by then)."""
        acc, cfg = self.session.accelerator, self.cfg
        scores = None
        if acc.is_main_process:
            hf_model = acc.unwrap_model(self.model).model  # the transformers model inside the loss wrapper
            try:
                scores = evaluate_tasks(
                    hf_model,
                    self.tokenizer,
                    cfg.eval_tasks,
                    self.session.out / "downstream",
                    limit=cfg.eval_tasks_limit,
                    device=str(acc.device),
                )
            except Exception as err:
                scores = self.evaluation_failed(err, periodic)
            if scores is not None:
                self.session.log(
                    {
                        f"downstream/{task}/{metric}": value
                        for task, metrics in scores.items()
                        for metric, value in metrics.items()
                        if metric != "n" and value is not None
                    }
                )
                lines = [f"downstream tasks at step {self.session.state.step}:", *score_lines(scores)]
                print("\n".join(lines), flush=True)
        acc.wait_for_everyone()
        self.model.train()
        if scores is not None:  # a failed periodic evaluation leaves the final one to run
            self.scored_at, self.last_scores = self.session.state.step, scores
        return scores

    def evaluations(self) -> Optional[float]:
        """The evaluations due at this step, after its checkpoint: the validation loss (returned, None when not due)
        and --eval_tasks; each evaluator owns its cadence, and neither counts as training time."""
        val = self.validator.maybe_run()
        self.task_scorer.maybe_run()
        return val

    def evaluation_failed(self, err: Exception, periodic: bool) -> None:
        """A periodic --eval_tasks evaluation that raised: logged (events.jsonl, a warning), training goes on. The
        final evaluation's failure ends the run in one line, after final/ was saved."""
        hf_model = self.session.accelerator.unwrap_model(self.model).model
        hf_model.train()
        step, what = self.session.state.step, f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
        if not periodic:
            raise UserError(
                f"the final evaluation on --eval_tasks failed ({what}); the model is saved in "
                f"{self.session.out / 'final'}: score it with merge_and_infer.py eval --model "
                f"{self.session.out / 'final'} once the task is fixed"
            ) from None
        self.event({"event": "eval_tasks_failed", "step": step, "error": what}, step)
        print(f"warning: --eval_tasks at step {step} failed ({what}); training goes on", flush=True)
        return None

    def evaluate(self) -> float:
        loss = validation_loss(self.session.accelerator, self.model, self.val_dl, self.cfg.eval_batches)
        self.session.log({"val/loss": loss, "val/perplexity": perplexity(loss)})
        self.model.train()
        return loss

    def rollback(self, spiked) -> None:
        """PaLM-style: back to the newest good checkpoint, lr x rollback_lr_factor, skip the data that spiked.
        `spiked` is the step whose loss ended the spike's patience; the steps run after it, before the collect that
        saw it, are discarded with the rest (their data is not skipped)."""
        cfg, session, state = self.cfg, self.session, self.session.state
        spike_step, loss, before = spiked.step, spiked.loss, self.rollbacks.state_dict()
        path, _ = ckpt.newest_good_checkpoint(session.out)
        if path is None:
            raise UserError(
                f"loss spike at step {spike_step} (loss {loss:.4g}) but no checkpoint to roll back "
                "to yet; lower --save_every or --learning_rate"
            )
        if before["rollbacks"] >= cfg.max_rollbacks:
            self.event(
                {
                    "event": "gave_up",
                    "step": spike_step,
                    "loss": loss,
                    "rollbacks": before["rollbacks"],
                    "checkpoint": str(path),
                },
                spike_step,
            )
            raise UserError(
                f"loss kept spiking (step {spike_step}, loss {loss:.4g}) after {before['rollbacks']} "
                f"rollbacks to {path.name} (--max_rollbacks); if it spikes right after every rollback "
                "the checkpoint or the data is at fault, else lower --learning_rate or --clip"
            )
        seen_at = state.step
        skipped = session.rewind(
            path,
            self.scheduler,
            cfg.learning_rate,
            lr_factor=cfg.rollback_lr_factor,
            skip_to=state.micro_batches - (seen_at - spike_step) * session.accelerator.gradient_accumulation_steps
            if cfg.rollback_skip_data
            else None,
        )
        self.rollbacks.load_state_dict({**before, "rollbacks": before["rollbacks"] + 1})
        self.detector.streak = 0
        self.batches = batch_stream(session.accelerator, self.train_dl, state.micro_batches)
        self.event(
            {
                "event": "rollback",
                "step": spike_step,
                "seen_at_step": seen_at,
                "loss": loss,
                "to_checkpoint": str(path),
                "resumed_step": state.step,
                "rollbacks": self.rollbacks.rollbacks,
                "lr_scale": state.lr_scale,
                "skipped_micro_batches": skipped,
            },
            spike_step,
        )
        session.accelerator.print(
            f"loss spike at step {spike_step}: rolled back to {path.name}, lr x {state.lr_scale:.3g}"
        )

    def event(self, record: dict, step: int) -> None:
        if self.session.accelerator.is_main_process:
            append_jsonl(self.session.out / "events.jsonl", {"time": time.time(), **record})
        self.session.log({f"events/{record['event']}": str(record), "train/rollbacks": self.rollbacks.rollbacks}, step)

    def final_samples(self) -> list[str]:
        """Greedy continuations of --sample_prompts by the final model, with repetition guards (no repeated
        trigram, repetition penalty 1.2) so a barely trained model does not just loop: the first thing a newcomer
        reads, and logged to TensorBoard's Text tab."""
        acc, cfg = self.session.accelerator, self.cfg
        if not (cfg.sample_prompts and cfg.sample_tokens and acc.is_main_process):
            return []
        model = acc.unwrap_model(self.model).model.eval()
        texts = []
        for prompt in cfg.sample_prompts:
            ids = self.tokenizer(prompt, return_tensors="pt").input_ids.to(acc.device)
            with torch.no_grad(), acc.autocast():
                out = model.generate(
                    ids,
                    max_new_tokens=cfg.sample_tokens,
                    do_sample=False,
                    no_repeat_ngram_size=3,
                    repetition_penalty=1.2,
                    pad_token_id=self.tokenizer.eos_token_id,
                )
            texts.append(self.tokenizer.decode(out[0], skip_special_tokens=True))
        print("\n".join(f"sample: {text!r}" for text in texts), flush=True)
        self.session.log({"samples/final": "\n\n".join(texts)}, self.session.state.step)
        return texts
