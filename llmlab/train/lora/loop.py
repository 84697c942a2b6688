"""LoRA domain adaptation: the training loop behind train_lora.py (its options: llmlab.train.lora.config).

One readable loop under accelerate (CPU, one GPU or several): prompt-masked loss on the answer tokens, the shared
optimizer / schedule factory (AdamW + linear warmup/decay by default), early stopping on validation loss that keeps
the best adapter, and a before/after evaluation on validation and on a test split no choice ever sees (perplexity and
ROUGE-L of greedy answers with paired bootstrap CIs, see llmlab.train.lora.evaluation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Optional

import torch
from accelerate.utils import set_seed
from peft import set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from llmlab.core.errors import UserError
from llmlab.core.identity import model_digest, records_digest
from llmlab.core.io import atomic_write_json
from llmlab.data.instruct import collate, load_records, pad_id_for, split_three, tokenize_records
from llmlab.train.checkpointing import assert_finite
from llmlab.train.config import CheckpointGroup, EvalGroup, LoggingGroup
from llmlab.train.engine import GradClipper
from llmlab.train.lora import evaluation as lora_eval
from llmlab.train.lora.config import RESUMABLE, RUN_FILES, LoraTrainConfig
from llmlab.train.lora.model import (
    BEST_ADAPTER_FILE,
    adapter_state,
    add_lora,
    check_base_model,
    checkpoint_trainable_weights_only,
    load_base_model,
    save_adapter,
)
from llmlab.train.loss import perplexity
from llmlab.train.optim import build_optimizer, build_schedule, check_deepspeed_choices
from llmlab.train.session import TrainingSession, scaled_schedule

__all__ = ["LoraTrainConfig", "train", "LoraRun"]


@dataclass
class LoraState:
    """LoRA's own resumable state: data position within the epoch, early stopping, the before-measurements."""

    epoch: int = 0
    epoch_micro_batches: int = 0
    best_loss: float = math.inf
    best_step: int = 0
    bad_evals: int = 0
    before: Optional[dict] = None

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)


def train(cfg: LoraTrainConfig) -> dict:
    """Adapt, evaluate before and after, save the best adapter; returns the eval.json content. This is the loop,
    read top to bottom: epochs, micro-batches, the engine's step, then the cadences."""
    # long: the loop is one piece on purpose: from the batches to the engine's step to every cadence, in order
    check_base_model(cfg)  # before any model loads: the most common first-run mistake answers at once
    session = TrainingSession(
        cfg,
        "lora",
        run_files=RUN_FILES,
        resumable=RESUMABLE,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
    )
    session.layout_hint = "model, data, batch sizes, processes and seed"
    with session:
        run = LoraRun(cfg, session)
        acc, state, lora = session.accelerator, session.state, run.lora
        run.start()
        stopped_early = False
        if lora.epoch_micro_batches >= len(run.train_loader):
            lora.epoch, lora.epoch_micro_batches = lora.epoch + 1, 0
        run.model.train()
        for epoch in range(lora.epoch, cfg.epochs):
            if stopped_early or state.step >= run.total_steps:
                break
            run.loader_seed.manual_seed(cfg.seed + epoch)  # each epoch's order depends on its index only: resumable
            skip, lora.epoch = lora.epoch_micro_batches, epoch
            for batch in acc.skip_first_batches(run.train_loader, skip) if skip else run.train_loader:
                lora.epoch_micro_batches += 1
                with acc.accumulate(run.model):
                    session.backward(run.answer_loss(batch), int(batch["attention_mask"].sum()))
                    if not acc.sync_gradients:
                        continue
                    params = [p for p in run.model.parameters() if p.requires_grad]
                    out = session.engine.step(params, run.optimizer, run.scheduler, run.clipper, state.step)
                session.record(out)  # the step's values stay on the device until a cadence needs them
                if session.collect_due():  # the meter, the checkpointer and the validator each own their cadence
                    session.meter.log_step(session.collect()[-1])
                stopped_early = run.after_step()
                if stopped_early or state.step >= run.total_steps:
                    break
                session.checkpointer.maybe_save(state.step)
            else:
                lora.epoch_micro_batches = 0
        return run.finish(stopped_early)


def summary(result: dict) -> dict:
    """One split's evaluation without its per-example lists (they feed the CIs, not eval.json)."""
    return {
        k: v for k, v in result.items() if k not in ("generations", "example_loss", "example_tokens", "example_rougeL")
    }


def eval_scalars(results: dict, when: str) -> dict:
    """eval/<split>_<metric>_<before|after> scalars for the trackers."""
    return {
        f"eval/{split}_{key}_{when}": value
        for split, result in results.items()
        for key, value in summary(result).items()
        if value is not None
    }


class LoraRun:
    """LoRA on top of the shared session: prompt-masked loss, early stopping, before/after evaluation."""

    def __init__(self, cfg: LoraTrainConfig, session):
        self.cfg, self.session = cfg, session
        acc = session.accelerator
        model, self.tokenizer, from_base = load_base_model(cfg)
        self.base_digest = model_digest(cfg.base_model)  # what the adapter belongs to: resume and merge check it
        checkpoint_trainable_weights_only(acc)
        set_seed(cfg.seed)
        self.adapter_tokenizer = None if from_base else self.tokenizer  # saved with the adapter only if not the base's
        self.load_data(model.config.max_position_embeddings)
        model = add_lora(model, cfg)
        trainable, total = model.get_nb_trainable_parameters()
        self.counts = {"trainable_params": trainable, "total_params": total}
        adapted = sorted({name.rsplit(".", 1)[-1] for name in model.peft_config["default"].target_modules})
        acc.print(
            f"LoRA r={cfg.lora_r} alpha={cfg.lora_alpha} on {adapted}: "
            f"{trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.3f}%)"
        )
        self.build_training(model)
        self.lora = LoraState()
        session.register(self.scheduler, self.clipper, self.lora)
        session.begin(
            cfg,
            self.total_steps,
            {
                "train_examples": len(self.train_examples),
                "num_processes": acc.num_processes,
                "base_model": self.base_digest,
                "data": self.data_digest,
            },
            CheckpointGroup.of(cfg),
            LoggingGroup.of(cfg),
            model=self.model,
            desc="lora",
            write_extra=lambda folder: self.save_best(folder / BEST_ADAPTER_FILE),
        )
        session.refresh_lr(self.scheduler, cfg.learning_rate)  # a resume honours a changed --learning_rate
        # each with its own cadence: samples every --sample_every steps, validation every --eval_every (and the last)
        self.sampler = session.evaluator(
            EvalGroup(eval_every=cfg.sample_every), self.sample, enabled=cfg.num_samples > 0
        )
        self.validator = session.evaluator(EvalGroup.of(cfg), self.validate)

    def load_data(self, context: int) -> None:
        cfg, acc = self.cfg, self.session.accelerator
        records = load_records(cfg.dataset, cfg.cache_dir, cfg.dataset_config, cfg.dataset_split)
        train_records, val_records, test_records = split_three(
            records, cfg.val_fraction, cfg.test_fraction, cfg.data_seed, cfg.max_examples
        )
        self.data_digest = records_digest(train_records + val_records + test_records)
        max_length = min(cfg.max_length, context)
        tokenize = partial(
            tokenize_records,
            self.tokenizer,
            max_length=max_length,
            prompt_template=cfg.prompt_template,
            prompt_template_no_input=cfg.prompt_template_no_input,
        )
        (self.train_examples, train_dropped), (self.val_examples, val_dropped) = (
            tokenize(train_records),
            tokenize(val_records),
        )
        self.test_examples, test_dropped = tokenize(test_records)
        if not self.train_examples or not self.val_examples:
            raise UserError(f"no example fits in --max_length {max_length}; raise it or shorten the prompts")
        dropped = train_dropped + val_dropped + test_dropped
        acc.print(
            f"data: {cfg.dataset}: {len(self.train_examples)} train / {len(self.val_examples)} validation / "
            f"{len(self.test_examples)} test examples, {acc.num_processes} process(es) on {acc.device.type}"
            + (f" ({dropped} dropped: prompt longer than {max_length} tokens)" if dropped else "")
        )

    def build_training(self, model) -> None:
        cfg, session, acc = self.cfg, self.session, self.session.accelerator
        self.pad_id = pad_id_for(self.tokenizer)
        self.loader_seed = torch.Generator().manual_seed(cfg.seed)
        train_loader = DataLoader(
            self.train_examples,
            batch_size=cfg.batch_size,
            shuffle=True,
            generator=self.loader_seed,
            collate_fn=partial(collate, pad_id=self.pad_id),
        )
        val_loader = DataLoader(
            self.val_examples, batch_size=cfg.eval_batch_size, collate_fn=partial(collate, pad_id=self.pad_id)
        )
        test_loader = DataLoader(
            self.test_examples, batch_size=cfg.eval_batch_size, collate_fn=partial(collate, pad_id=self.pad_id)
        )
        check_deepspeed_choices(acc, cfg.optimizer, cfg.clip_mode)
        optimizer = build_optimizer(cfg.optimizer, model.parameters(), cfg.learning_rate, cfg.weight_decay)
        self.model, self.optimizer, self.train_loader, self.val_loader, self.test_loader = session.prepare(
            model, optimizer, train_loader, val_loader, test_loader
        )
        # Logits only where the loss needs them (answer positions), if that reproduces the model's own.
        probe = {k: v.to(acc.device) for k, v in collate(self.val_examples[:4], self.pad_id).items()}
        self.logits_mode = lora_eval.pick_logits_mode(acc.unwrap_model(self.model).get_base_model(), probe)
        self.head = acc.unwrap_model(self.model).get_output_embeddings()
        if self.logits_mode != "gather":
            acc.print(f"note: {self.logits_mode} logits: this model's output is not a plain head(hidden states)")
        steps_per_epoch = math.ceil(len(self.train_loader) / cfg.gradient_accumulation_steps)
        self.total_steps = min(cfg.max_steps or math.inf, cfg.epochs * steps_per_epoch)
        # Stepped by hand once per optimizer step (not prepared): the step counts above are already per process.
        self.scheduler = scaled_schedule(
            build_schedule(
                self.optimizer, cfg.lr_scheduler, cfg.warmup_steps, self.total_steps, options=cfg.schedule_options
            ),
            session.state,
        )
        self.clipper = GradClipper(cfg.clip, warmup_steps=cfg.warmup_steps, clip_mode=cfg.clip_mode)
        split = partial(
            lora_eval.evaluate_split,
            accelerator=acc,
            tokenizer=self.tokenizer,
            pad_id=self.pad_id,
            batch_size=cfg.eval_batch_size,
            max_new_tokens=cfg.max_new_tokens,
            mode=self.logits_mode,
            head=self.head,
        )
        splits = {"validation": (self.val_loader, self.val_examples), "test": (self.test_loader, self.test_examples)}
        self.evaluate = (
            lambda model: {  # noqa: E731  (every split, the same way, before and after)
                name: split(model, loader=loader, rouge_examples=examples[: cfg.eval_examples])
                for name, (loader, examples) in splits.items()
                if examples
            }
        )

    # ------------------------------------------------------------------ adapter bookkeeping
    def adapter_now(self) -> dict:
        return adapter_state(self.session.accelerator.unwrap_model(self.model))

    def save_best(self, path: Path) -> None:
        save_file(self.best_state, path)

    def publish_best(self) -> None:
        """The adapter folder always holds the best adapter this run knows of."""
        if not self.session.accelerator.is_main_process:
            return
        unwrapped = self.session.accelerator.unwrap_model(self.model)
        current = self.adapter_now()
        set_peft_model_state_dict(unwrapped, self.best_state)
        assert_finite(unwrapped, "adapter")
        save_adapter(unwrapped, self.cfg, self.session.out / "adapter", self.adapter_tokenizer, self.base_digest)
        set_peft_model_state_dict(unwrapped, current)

    # ------------------------------------------------------------------ the run
    def start(self) -> None:
        """Before the first step: the base model's scores (the first candidate for best), or the resumed best."""
        cfg, session, lora = self.cfg, self.session, self.lora
        if session.resume_path is None:
            session.accelerator.print(
                f"evaluating the base model on {len(self.val_examples)} validation and "
                f"{len(self.test_examples)} test examples (ROUGE-L on up to {cfg.eval_examples} "
                "of each)..."
            )
            with session.meter.paused():
                lora.before = self.evaluate(self.model)
            # val/* is the validation curve (step 0 = base model); eval/* are the before/after measurements.
            before = lora.before["validation"]
            session.log(
                {
                    "val/loss": before["loss"],
                    "val/perplexity": before["perplexity"],
                    **eval_scalars(lora.before, "before"),
                },
                0,
            )
            # The untrained adapter (B = 0) is the base model: it is the first candidate for "best".
            lora.best_loss, lora.best_step, self.best_state = before["loss"], 0, self.adapter_now()
        else:
            self.best_state = load_file(session.resume_path / BEST_ADAPTER_FILE)
            session.accelerator.print(f"best validation loss so far {lora.best_loss:.4f} at step {lora.best_step}")
        self.publish_best()

    def answer_loss(self, batch) -> torch.Tensor:
        """The prompt-masked loss: answer tokens only."""
        logits, targets, _ = lora_eval.answer_logits(self.model, batch, self.logits_mode, self.head)
        return lora_eval.answer_loss(logits, targets, self.cfg.label_smoothing)

    def after_step(self) -> bool:
        """The samples and the validation, each at its own cadence; True when early stopping ends the run."""
        self.sampler.maybe_run()
        return bool(self.validator.maybe_run())

    def sample(self) -> None:
        """Greedy answers to the first --num_samples validation prompts, to TensorBoard's Text tab."""
        cfg, session = self.cfg, self.session
        text = lora_eval.samples_markdown(
            session.accelerator,
            self.model,
            self.tokenizer,
            self.val_examples[: cfg.num_samples],
            self.pad_id,
            cfg.max_new_tokens,
        )
        session.log({"samples": text}, session.state.step)
        self.model.train()

    def validate(self) -> bool:
        """The validation loss; a better one publishes the adapter as the best. True when --patience evaluations
        in a row did not improve it by more than --min_delta."""
        cfg, session, lora, acc = self.cfg, self.session, self.lora, self.session.accelerator
        step = session.state.step
        val_loss = lora_eval.adapter_validation_loss(self.model, self.val_loader, acc, self.logits_mode, self.head)
        session.log({"val/loss": val_loss, "val/perplexity": perplexity(val_loss)}, step)
        if val_loss < lora.best_loss - cfg.min_delta:
            lora.best_loss, lora.best_step, lora.bad_evals = val_loss, step, 0
            self.best_state = self.adapter_now()
            self.publish_best()
        else:
            lora.bad_evals += 1
        session.meter.bar.write(
            f"step {step}: val loss {val_loss:.4f} (best {lora.best_loss:.4f} at step {lora.best_step})"
        )
        self.model.train()
        return lora.bad_evals >= cfg.patience

    def finish(self, stopped_early: bool) -> dict:
        cfg, session, lora, acc = self.cfg, self.session, self.lora, self.session.accelerator
        if stopped_early:
            acc.print(
                f"early stop at step {session.state.step}: validation loss has not improved "
                f"for {cfg.patience} evaluations"
            )
        set_peft_model_state_dict(acc.unwrap_model(self.model), self.best_state)  # evaluate the adapter we keep
        acc.print(f"evaluating the best adapter (step {lora.best_step})...")
        after = self.evaluate(self.model)
        session.log(eval_scalars(after, "after"), session.state.step)
        shown_split = "test" if "test" in after else "validation"
        shown = self.test_examples if shown_split == "test" else self.val_examples
        report = {
            "base_model": cfg.base_model,
            "base_model_digest": self.base_digest,
            "dataset": cfg.dataset,
            "data_digest": self.data_digest,
            "train_examples": len(self.train_examples),
            "val_examples": len(self.val_examples),
            "test_examples": len(self.test_examples),
            "rouge_examples": min(cfg.eval_examples, len(shown)),
            "steps": session.state.step,
            "best_step": lora.best_step,
            "stopped_early": stopped_early,
            **self.counts,
            "before": {split: summary(result) for split, result in lora.before.items()},
            "after": {split: summary(result) for split, result in after.items()},
            "change": {split: lora_eval.paired_change(lora.before[split], after[split], cfg.seed) for split in after},
            "examples": lora_eval.example_rows(
                shown[: cfg.eval_examples], lora.before[shown_split]["generations"], after[shown_split]["generations"]
            ),
        }
        if acc.is_main_process:
            report["adapter_bytes"] = sum(f.stat().st_size for f in (session.out / "adapter").iterdir())
            atomic_write_json(session.out / "eval.json", report)
            print(lora_eval.before_after_table(report))
            print(
                f"adapter ({report['adapter_bytes'] / 1e6:.2f} MB): {session.out / 'adapter'}  "
                f"eval: {session.out / 'eval.json'}"
            )
        acc.wait_for_everyone()
        return report
