"""LoRA domain adaptation: the config and the training loop behind train_lora.py.

One readable loop under accelerate (CPU, one GPU or several): prompt-masked loss on the answer tokens,
the shared optimizer / schedule factory (AdamW + linear warmup/decay by default), early stopping on validation loss that keeps the best adapter, and a
before/after evaluation (validation perplexity and ROUGE-L of greedy answers, see llmlab.train.lora_eval).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from llmlab.core.config import opt
from llmlab.core.identity import model_digest, records_digest
from llmlab.core.errors import UserError
from llmlab.data.instruct import DEFAULT_PROMPT, DEFAULT_PROMPT_NO_INPUT, check_templates
from llmlab.core.io import llmlab_cache
from llmlab.train.lora_model import (BEST_ADAPTER_FILE, DEFAULT_BASE_MODEL, adapter_state, add_lora, check_base_model,
                               checkpoint_trainable_weights_only, load_base_model,
                               save_adapter)


def default_instruct_cache() -> str:
    return str(llmlab_cache("instruct"))


@dataclass
class LoraTrainConfig:
    # model and data
    base_model: str = opt(DEFAULT_BASE_MODEL, "model to adapt: a save_pretrained folder (train_pretrain.py writes "
                                              "runs/pretrain/final) or any Hugging Face causal-LM name")
    tokenizer: Optional[str] = opt(None, "tokenizer name/path (default: the base model's own, else offline GPT-2 BPE)")
    dataset: str = opt("builtin:pydoc", "instruction data: builtin:pydoc (offline, from the Python stdlib's "
                                        "docstrings), a .jsonl/.json file or a hub dataset with "
                                        "instruction/input/output")
    dataset_config: Optional[str] = opt(None, "hub dataset configuration name")
    dataset_split: str = opt("train", "hub dataset split to read (it is then split 90/10 here)")
    max_examples: Optional[int] = opt(None, "use a seeded random subset of this many records (quick runs)")
    cache_dir: str = opt(default_instruct_cache(), "folder for the builtin:pydoc cache")
    val_fraction: float = opt(0.1, "fraction of the non-test records held out for validation (early stopping and "
                                   "choosing the best adapter use it)")
    test_fraction: float = opt(0.1, "fraction of records held out as a test split that no training choice ever sees: "
                                    "its before/after numbers are the ones to quote")
    data_seed: int = opt(1234, "seed of the train/validation split")
    max_length: int = opt(256, "max tokens of prompt + answer + eos (capped at the model's context)")
    prompt_template: str = opt(DEFAULT_PROMPT, "prompt for records with an input; uses {instruction} and {input}")
    prompt_template_no_input: str = opt(DEFAULT_PROMPT_NO_INPUT, "prompt for records with an empty input")
    # adapter
    lora_r: int = opt(8, "LoRA rank")
    lora_alpha: int = opt(16, "LoRA alpha (scale = alpha / r)")
    lora_dropout: float = opt(0.1, "dropout on the LoRA branch")
    target_modules: Optional[list[str]] = opt(None, "modules to adapt, e.g. c_attn (GPT-2) or q_proj v_proj "
                                                    "(Llama); default: peft's choice for the model type")
    # optimisation
    optimizer: Literal["adamw", "lion", "adafactor"] = opt("adamw", "adamw, lion (takes lr / 3 and weight decay x 3 "
                                                                   "of the values given: llmlab.train.optim) or "
                                                                   "adafactor (fixed lr)")
    learning_rate: float = opt(3e-4, "peak learning rate")
    weight_decay: float = opt(0.01, "weight decay (LoRA's A and B matrices)")
    batch_size: int = opt(16, "examples per device per micro-batch")
    gradient_accumulation_steps: int = opt(2, "micro-batches per optimizer step")
    lr_scheduler: Literal["linear", "cosine", "polynomial", "constant"] = opt("linear", "decay after the linear warmup "
                                                                                       "(to 0; polynomial: power 2)")
    warmup_steps: int = opt(100, "linear warmup optimizer steps")
    epochs: int = opt(3, "passes over the training split (upper bound)")
    max_steps: Optional[int] = opt(None, "stop after this many optimizer steps (upper bound)")
    clip: str = opt("1.0", "max grad norm, 0 = off, or 'adaptive' (1.5x mean of the last 50 norms)")
    clip_mode: Literal["norm", "value"] = opt("norm", "clip the global gradient norm, or clamp every gradient "
                                                      "element to [-clip, clip]")
    label_smoothing: float = opt(0.0, "label smoothing of the training loss (validation loss never smooths)")
    gradient_checkpointing: bool = opt(False, "recompute activations in backward to save memory")
    # evaluation and logging
    eval_every: int = opt(50, "optimizer steps between validation-loss evaluations")
    patience: int = opt(3, "stop after this many evaluations without a better validation loss")
    min_delta: float = opt(0.0, "an improvement must lower the validation loss by more than this")
    eval_batch_size: int = opt(16, "batch size for validation loss and generation")
    eval_examples: int = opt(64, "validation examples whose greedy answers are scored with ROUGE-L")
    max_new_tokens: int = opt(64, "max generated tokens per answer")
    sample_every: int = opt(100, "optimizer steps between sample generations logged to TensorBoard text")
    num_samples: int = opt(3, "validation prompts shown in each sample log")
    log_every: int = opt(10, "optimizer steps between scalar logs")
    # checkpoints
    save_every: int = opt(100, "save a resumable checkpoint (adapter, optimizer, scheduler, RNG, data position) "
                               "every N optimizer steps; 0 = never")
    keep_last: int = opt(2, "keep only the newest N checkpoints")
    resume_from_checkpoint: Optional[str] = opt(None, "'latest' or a checkpoints/step_N folder to continue from")
    seed: int = opt(0, "seed for LoRA init, dropout and shuffling")
    cpu_threads: int = opt(0, "CPU threads per process; 0 = PyTorch's default, or all cores when `accelerate "
                              "launch` forced OMP_NUM_THREADS=1")
    output_dir: str = opt("runs/lora", "run folder: adapter/, eval.json, checkpoints/, config.yaml, "
                                           "tensorboard/")
    overwrite_output_dir: bool = opt(False, "start afresh in an --output_dir that already holds a LoRA run (deletes "
                                            "that run's adapter/, checkpoints/, eval.json and logs, nothing else)")
    report_to: list[str] = opt(["tensorboard"], "trackers: tensorboard, wandb, mlflow, aim, comet_ml, all or none "
                                                "(metrics.jsonl is always written)")

    def validate(self) -> None:
        positive = ("max_length", "lora_r", "batch_size", "gradient_accumulation_steps", "epochs", "eval_every",
                    "patience", "eval_batch_size", "max_new_tokens", "sample_every", "log_every", "keep_last")
        for name in positive:
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "max_examples"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UserError(f"--{name} must be >= 1 (or omitted), got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_examples", "num_samples", "save_every", "cpu_threads"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.val_fraction < 1:
            raise UserError(f"--val_fraction must be between 0 and 1, got {self.val_fraction}")
        if not 0 <= self.test_fraction < 1 or not self.val_fraction + self.test_fraction < 1:
            raise UserError(f"--test_fraction must be in [0, 1) and leave records to train on (with --val_fraction), got "
                            f"{self.test_fraction}")
        if not 0 <= self.lora_dropout < 1:
            raise UserError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if not 0 <= self.label_smoothing < 1:
            raise UserError(f"--label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.learning_rate < 0 or self.weight_decay < 0:
            raise UserError("--learning_rate and --weight_decay must be >= 0")
        from llmlab.core.tracking import check_report_to
        from llmlab.train.common import parse_clip

        parse_clip(self.clip)
        check_templates(self.prompt_template, self.prompt_template_no_input)
        check_report_to(self.report_to)


RUN_FILES = ("adapter", "checkpoints", "eval.json", "metrics.jsonl", "tensorboard", "config.yaml", "run_info.json")
# Options a resume may change: the run's length and lr (the schedule is recomputed from them), cadences and
# evaluation settings. Anything that changes the model, the data or its order is refused, naming the option.
RESUMABLE = ("max_steps", "epochs", "learning_rate", "warmup_steps", "eval_every", "patience", "min_delta",
             "eval_batch_size", "eval_examples", "max_new_tokens", "sample_every", "num_samples", "log_every",
             "save_every", "keep_last", "clip", "gradient_checkpointing")


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
    """Adapt, evaluate before and after, save the best adapter; returns the eval.json content."""
    from llmlab.train.loop import TrainingSession

    check_base_model(cfg)  # before the slow imports: the most common first-run mistake answers at once
    session = TrainingSession(cfg, "lora", run_files=RUN_FILES, resumable=RESUMABLE,
                              gradient_accumulation_steps=cfg.gradient_accumulation_steps)
    session.layout_hint = "model, data, batch sizes, processes and seed"
    with session:
        return LoraRun(cfg, session).run()


def summary(result: dict) -> dict:
    """One split's evaluation without its per-example lists (they feed the CIs, not eval.json)."""
    return {k: v for k, v in result.items() if k not in ("generations", "example_loss", "example_tokens",
                                                         "example_rougeL")}


def eval_scalars(results: dict, when: str) -> dict:
    """eval/<split>_<metric>_<before|after> scalars for the trackers."""
    return {f"eval/{split}_{key}_{when}": value for split, result in results.items()
            for key, value in summary(result).items() if value is not None}


class LoraRun:
    """LoRA on top of the shared session: prompt-masked loss, early stopping, before/after evaluation."""

    def __init__(self, cfg: LoraTrainConfig, session):
        from accelerate.utils import set_seed

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
        acc.print(f"LoRA r={cfg.lora_r} alpha={cfg.lora_alpha} on {sorted(model.peft_config['default'].target_modules)}: "
                  f"{trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.3f}%)")
        self.build_training(model)
        self.lora = LoraState()
        session.register(self.scheduler, self.clipper, self.lora)
        session.begin(self.total_steps, {"train_examples": len(self.train_examples),
                                         "num_processes": acc.num_processes, "base_model": self.base_digest,
                                         "data": self.data_digest},
                      cfg.save_every, cfg.keep_last, model=self.model, desc="lora",
                      write_extra=lambda folder: self.save_best(folder / BEST_ADAPTER_FILE))
        session.refresh_lr(self.scheduler, cfg.learning_rate)  # a resume honours a changed --learning_rate

    def load_data(self, context: int) -> None:
        from functools import partial

        from llmlab.data.instruct import load_records, split_three, tokenize_records

        cfg, acc = self.cfg, self.session.accelerator
        records = load_records(cfg.dataset, cfg.cache_dir, cfg.dataset_config, cfg.dataset_split)
        train_records, val_records, test_records = split_three(records, cfg.val_fraction, cfg.test_fraction,
                                                               cfg.data_seed, cfg.max_examples)
        self.data_digest = records_digest(train_records + val_records + test_records)
        max_length = min(cfg.max_length, context)
        tokenize = partial(tokenize_records, self.tokenizer, max_length=max_length,
                           prompt_template=cfg.prompt_template, prompt_template_no_input=cfg.prompt_template_no_input)
        (self.train_examples, train_dropped), (self.val_examples, val_dropped) = tokenize(train_records), tokenize(val_records)
        self.test_examples, test_dropped = tokenize(test_records)
        if not self.train_examples or not self.val_examples:
            raise UserError(f"no example fits in --max_length {max_length}; raise it or shorten the prompts")
        dropped = train_dropped + val_dropped + test_dropped
        acc.print(f"data: {cfg.dataset}: {len(self.train_examples)} train / {len(self.val_examples)} validation / "
                  f"{len(self.test_examples)} test examples, {acc.num_processes} process(es) on {acc.device.type}"
                  + (f" ({dropped} dropped: prompt longer than {max_length} tokens)" if dropped else ""))

    def build_training(self, model) -> None:
        from functools import partial

        import torch
        from torch.utils.data import DataLoader
        from llmlab.data.instruct import collate, pad_id_for
        from llmlab.train import lora_eval
        from llmlab.train.common import GradClipper
        from llmlab.train.loop import scaled_schedule
        from llmlab.train.optim import build_optimizer, build_schedule, check_deepspeed_choices

        cfg, session, acc = self.cfg, self.session, self.session.accelerator
        self.pad_id = pad_id_for(self.tokenizer)
        self.loader_seed = torch.Generator().manual_seed(cfg.seed)
        train_loader = DataLoader(self.train_examples, batch_size=cfg.batch_size, shuffle=True,
                                  generator=self.loader_seed, collate_fn=partial(collate, pad_id=self.pad_id))
        val_loader = DataLoader(self.val_examples, batch_size=cfg.eval_batch_size,
                                collate_fn=partial(collate, pad_id=self.pad_id))
        test_loader = DataLoader(self.test_examples, batch_size=cfg.eval_batch_size,
                                 collate_fn=partial(collate, pad_id=self.pad_id))
        check_deepspeed_choices(acc, cfg.optimizer, cfg.clip_mode)
        optimizer = build_optimizer(cfg.optimizer, model.parameters(), cfg.learning_rate, cfg.weight_decay)
        self.model, self.optimizer, self.train_loader, self.val_loader, self.test_loader = session.prepare(
            model, optimizer, train_loader, val_loader, test_loader)
        # Logits only where the loss needs them (answer positions), if that reproduces the model's own.
        probe = {k: v.to(acc.device) for k, v in collate(self.val_examples[:4], self.pad_id).items()}
        self.logits_mode = lora_eval.pick_logits_mode(acc.unwrap_model(self.model).get_base_model(), probe)
        self.head = acc.unwrap_model(self.model).get_output_embeddings()
        if self.logits_mode != "gather":
            acc.print(f"note: {self.logits_mode} logits: this model's output is not a plain head(hidden states)")
        steps_per_epoch = math.ceil(len(self.train_loader) / cfg.gradient_accumulation_steps)
        self.total_steps = min(cfg.max_steps or math.inf, cfg.epochs * steps_per_epoch)
        # Stepped by hand once per optimizer step (not prepared): the step counts above are already per process.
        self.scheduler = scaled_schedule(build_schedule(self.optimizer, cfg.lr_scheduler, cfg.warmup_steps,
                                                        self.total_steps), session.state)
        self.clipper = GradClipper(cfg.clip, warmup_steps=cfg.warmup_steps, clip_mode=cfg.clip_mode)
        split = partial(lora_eval.evaluate_split, accelerator=acc, tokenizer=self.tokenizer, pad_id=self.pad_id,
                        batch_size=cfg.eval_batch_size, max_new_tokens=cfg.max_new_tokens, mode=self.logits_mode,
                        head=self.head)
        splits = {"validation": (self.val_loader, self.val_examples), "test": (self.test_loader, self.test_examples)}
        self.evaluate = lambda model: {  # noqa: E731  (every split, the same way, before and after)
            name: split(model, loader=loader, rouge_examples=examples[: cfg.eval_examples])
            for name, (loader, examples) in splits.items() if examples}

    # ------------------------------------------------------------------ adapter bookkeeping
    def adapter_now(self) -> dict:
        return adapter_state(self.session.accelerator.unwrap_model(self.model))

    def save_best(self, path: Path) -> None:
        from safetensors.torch import save_file

        save_file(self.best_state, path)

    def publish_best(self) -> None:
        """The adapter folder always holds the best adapter this run knows of."""
        from peft import set_peft_model_state_dict

        from llmlab.train.checkpointing import assert_finite

        if not self.session.accelerator.is_main_process:
            return
        unwrapped = self.session.accelerator.unwrap_model(self.model)
        current = self.adapter_now()
        set_peft_model_state_dict(unwrapped, self.best_state)
        assert_finite(unwrapped, "adapter")
        save_adapter(unwrapped, self.cfg, self.session.out / "adapter", self.adapter_tokenizer, self.base_digest)
        set_peft_model_state_dict(unwrapped, current)

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        cfg, session, lora = self.cfg, self.session, self.lora
        if session.resume_path is None:
            session.accelerator.print(f"evaluating the base model on {len(self.val_examples)} validation and "
                                      f"{len(self.test_examples)} test examples (ROUGE-L on up to {cfg.eval_examples} "
                                      "of each)...")
            with session.paused():
                lora.before = self.evaluate(self.model)
            # val/* is the validation curve (step 0 = base model); eval/* are the before/after measurements.
            before = lora.before["validation"]
            session.log({"val/loss": before["loss"], "val/perplexity": before["perplexity"],
                         **eval_scalars(lora.before, "before")}, 0)
            # The untrained adapter (B = 0) is the base model: it is the first candidate for "best".
            lora.best_loss, lora.best_step, self.best_state = before["loss"], 0, self.adapter_now()
        else:
            from safetensors.torch import load_file

            self.best_state = load_file(session.resume_path / BEST_ADAPTER_FILE)
            session.accelerator.print(f"best validation loss so far {lora.best_loss:.4f} at step {lora.best_step}")
        self.publish_best()
        stopped_early = self.train_epochs()
        if stopped_early:
            session.accelerator.print(f"early stop at step {session.state.step}: validation loss has not improved "
                                      f"for {cfg.patience} evaluations")
        return self.finish(stopped_early)

    def train_epochs(self) -> bool:
        cfg, session, lora, acc = self.cfg, self.session, self.lora, self.session.accelerator
        if lora.epoch_micro_batches >= len(self.train_loader):
            lora.epoch, lora.epoch_micro_batches = lora.epoch + 1, 0
        self.model.train()
        for epoch in range(lora.epoch, cfg.epochs):
            if session.state.step >= self.total_steps:
                break
            self.loader_seed.manual_seed(cfg.seed + epoch)  # each epoch's order depends on its index only: resumable
            skip, lora.epoch = lora.epoch_micro_batches, epoch
            batches = acc.skip_first_batches(self.train_loader, skip) if skip else self.train_loader
            for batch in batches:
                lora.epoch_micro_batches += 1
                result = self.micro_step(batch)
                if result is None:
                    continue
                session.log_step(result, cfg.log_every)
                if self.after_step():
                    return True
                if session.state.step >= self.total_steps:
                    return False
                session.checkpointer.maybe_save(session.state.step)
            lora.epoch_micro_batches = 0
        return False

    def micro_step(self, batch):
        from llmlab.train import lora_eval

        acc, session = self.session.accelerator, self.session
        with acc.accumulate(self.model):
            logits, targets, _ = lora_eval.answer_logits(self.model, batch, self.logits_mode, self.head)
            session.backward(lora_eval.answer_loss(logits, targets, self.cfg.label_smoothing),
                             int(batch["attention_mask"].sum()))
            if acc.sync_gradients:
                params = [p for p in self.model.parameters() if p.requires_grad]
                return session.optimizer_step(params, self.optimizer, self.scheduler, self.clipper)
        return None

    def after_step(self) -> bool:
        """Samples and evaluation at their cadence; True when early stopping ends the run."""
        from llmlab.train import lora_eval
        from llmlab.train.common import perplexity

        cfg, session, lora, acc = self.cfg, self.session, self.lora, self.session.accelerator
        step = session.state.step
        with session.paused():
            if step % cfg.sample_every == 0 and cfg.num_samples:
                text = lora_eval.samples_markdown(acc, self.model, self.tokenizer, self.val_examples[: cfg.num_samples],
                                                  self.pad_id, cfg.max_new_tokens)
                session.log({"samples": text}, step)
                self.model.train()
            if not session.due(cfg.eval_every):
                return False
            val_loss = lora_eval.adapter_validation_loss(self.model, self.val_loader, acc, self.logits_mode, self.head)
            session.log({"val/loss": val_loss, "val/perplexity": perplexity(val_loss)}, step)
            if val_loss < lora.best_loss - cfg.min_delta:
                lora.best_loss, lora.best_step, lora.bad_evals = val_loss, step, 0
                self.best_state = self.adapter_now()
                self.publish_best()
            else:
                lora.bad_evals += 1
            session.bar.write(f"step {step}: val loss {val_loss:.4f} (best {lora.best_loss:.4f} at step {lora.best_step})")
            self.model.train()
        return lora.bad_evals >= cfg.patience

    def finish(self, stopped_early: bool) -> dict:
        from peft import set_peft_model_state_dict

        from llmlab.core.io import atomic_write_json
        from llmlab.train import lora_eval

        cfg, session, lora, acc = self.cfg, self.session, self.lora, self.session.accelerator
        set_peft_model_state_dict(acc.unwrap_model(self.model), self.best_state)  # evaluate the adapter we keep
        acc.print(f"evaluating the best adapter (step {lora.best_step})...")
        after = self.evaluate(self.model)
        session.log(eval_scalars(after, "after"), session.state.step)
        shown_split = "test" if "test" in after else "validation"
        shown = self.test_examples if shown_split == "test" else self.val_examples
        report = {
            "base_model": cfg.base_model, "base_model_digest": self.base_digest, "dataset": cfg.dataset,
            "data_digest": self.data_digest, "train_examples": len(self.train_examples),
            "val_examples": len(self.val_examples), "test_examples": len(self.test_examples),
            "rouge_examples": min(cfg.eval_examples, len(shown)), "steps": session.state.step,
            "best_step": lora.best_step, "stopped_early": stopped_early, **self.counts,
            "before": {split: summary(result) for split, result in lora.before.items()},
            "after": {split: summary(result) for split, result in after.items()},
            "change": {split: lora_eval.paired_change(lora.before[split], after[split], cfg.seed)
                       for split in after},
            "examples": lora_eval.example_rows(shown[: cfg.eval_examples], lora.before[shown_split]["generations"],
                                               after[shown_split]["generations"]),
        }
        if acc.is_main_process:
            report["adapter_bytes"] = sum(f.stat().st_size for f in (session.out / "adapter").iterdir())
            atomic_write_json(session.out / "eval.json", report)
            print(lora_eval.before_after_table(report))
            print(f"adapter ({report['adapter_bytes'] / 1e6:.2f} MB): {session.out / 'adapter'}  "
                  f"eval: {session.out / 'eval.json'}")
        acc.wait_for_everyone()
        return report
