"""LoRA domain adaptation: the config and the training loop behind train_lora.py.

One readable loop under accelerate (CPU, one GPU or several): prompt-masked loss on the answer tokens,
AdamW + linear warmup/decay, early stopping on validation loss that keeps the best adapter, and a
before/after evaluation (validation perplexity and ROUGE-L of greedy answers, see llmlab.train.lora_eval).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal, Optional

from llmlab.core.config import opt
from llmlab.core.errors import UserError
from llmlab.data.instruct import DEFAULT_PROMPT, DEFAULT_PROMPT_NO_INPUT, check_templates
from llmlab.core.io import llmlab_cache
from llmlab.train.lora_model import (BEST_ADAPTER_FILE, DEFAULT_BASE_MODEL, adapter_state, add_lora, check_base_model,
                               checkpoint_trainable_weights_only, load_base_model,
                               quiet_optional_backends, save_adapter)


def default_cache_dir() -> str:
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
    cache_dir: str = opt(default_cache_dir(), "folder for the builtin:pydoc cache")
    val_fraction: float = opt(0.1, "fraction of records held out for validation")
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
    learning_rate: float = opt(3e-4, "peak AdamW learning rate")
    weight_decay: float = opt(0.01, "AdamW weight decay")
    batch_size: int = opt(16, "examples per device per micro-batch")
    gradient_accumulation_steps: int = opt(2, "micro-batches per optimizer step")
    lr_scheduler: Literal["linear", "cosine", "constant_with_warmup"] = opt("linear", "schedule after warmup")
    warmup_steps: int = opt(100, "linear warmup optimizer steps")
    epochs: int = opt(3, "passes over the training split (upper bound)")
    max_steps: Optional[int] = opt(None, "stop after this many optimizer steps (upper bound)")
    clip: str = opt("1.0", "max grad norm, 0 = off, or 'adaptive' (1.5x mean of the last 50 norms)")
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
    output_dir: str = opt("runs/lora", "run folder: adapter/, eval.json, checkpoints/, config.yaml, "
                                           "tensorboard/")

    def validate(self) -> None:
        positive = ("max_length", "lora_r", "batch_size", "gradient_accumulation_steps", "epochs", "eval_every",
                    "patience", "eval_batch_size", "max_new_tokens", "sample_every", "log_every", "keep_last")
        for name in positive:
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "max_examples"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UserError(f"--{name} must be >= 1 (or omitted), got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_examples", "num_samples", "save_every"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.val_fraction < 1:
            raise UserError(f"--val_fraction must be between 0 and 1, got {self.val_fraction}")
        if not 0 <= self.lora_dropout < 1:
            raise UserError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if not 0 <= self.label_smoothing < 1:
            raise UserError(f"--label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.learning_rate < 0 or self.weight_decay < 0:
            raise UserError("--learning_rate and --weight_decay must be >= 0")
        from llmlab.train.common import parse_clip

        parse_clip(self.clip)
        check_templates(self.prompt_template, self.prompt_template_no_input)


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------

def make_accelerator(cfg: LoraTrainConfig):
    from accelerate import Accelerator

    from llmlab.train.common import process_group_handlers

    return Accelerator(gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                       kwargs_handlers=process_group_handlers())


def train(cfg: LoraTrainConfig) -> dict:
    """Adapt, evaluate before and after, save the best adapter; returns the eval.json content."""
    from llmlab.train import checkpointing as ckpt

    check_base_model(cfg)  # before the slow imports: the most common first-run mistake answers at once
    resume_path = None
    if cfg.resume_from_checkpoint:  # fail fast, before the model and data are built
        resume_path = ckpt.resolve_checkpoint(cfg.output_dir, cfg.resume_from_checkpoint)
        ckpt.read_trainer_state(resume_path)
    quiet_optional_backends()
    import torch
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    from llmlab.train import lora_eval
    from llmlab.data.instruct import collate, load_records, pad_id_for, split_records, tokenize_records
    from llmlab.core.runinfo import write_run_info
    from llmlab.core.tracking import MetricsLogger
    from llmlab.train.common import GradClipper, perplexity
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    out = Path(cfg.output_dir)
    model, tokenizer, tokenizer_from_base = load_base_model(cfg)
    accelerator = make_accelerator(cfg)
    checkpoint_trainable_weights_only(accelerator)
    main = accelerator.is_main_process
    say = accelerator.print
    set_seed(cfg.seed)

    records = load_records(cfg.dataset, cfg.cache_dir, cfg.dataset_config, cfg.dataset_split)
    train_records, val_records = split_records(records, cfg.val_fraction, cfg.data_seed, cfg.max_examples)
    max_length = min(cfg.max_length, model.config.max_position_embeddings)
    tokenize = partial(tokenize_records, tokenizer, max_length=max_length, prompt_template=cfg.prompt_template,
                       prompt_template_no_input=cfg.prompt_template_no_input)
    (train_examples, train_dropped), (val_examples, val_dropped) = tokenize(train_records), tokenize(val_records)
    if not train_examples or not val_examples:
        raise UserError(f"no example fits in --max_length {max_length}; raise it or shorten the prompts")
    say(f"data: {cfg.dataset}: {len(train_examples)} train / {len(val_examples)} validation examples, "
        f"{accelerator.num_processes} process(es) on {accelerator.device.type}"
        + (f" ({train_dropped + val_dropped} dropped: prompt longer than {max_length} tokens)"
           if train_dropped + val_dropped else ""))

    model = add_lora(model, cfg)
    trainable, total = model.get_nb_trainable_parameters()
    say(f"LoRA r={cfg.lora_r} alpha={cfg.lora_alpha} on {sorted(model.peft_config['default'].target_modules)}: "
        f"{trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.3f}%)")

    pad_id = pad_id_for(tokenizer)
    adapter_tokenizer = None if tokenizer_from_base else tokenizer
    loader_seed = torch.Generator().manual_seed(cfg.seed)
    train_loader = DataLoader(train_examples, batch_size=cfg.batch_size, shuffle=True, generator=loader_seed,
                              collate_fn=partial(collate, pad_id=pad_id))
    val_loader = DataLoader(val_examples, batch_size=cfg.eval_batch_size, collate_fn=partial(collate, pad_id=pad_id))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate,
                                  weight_decay=cfg.weight_decay)
    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)
    # Logits only where the loss needs them (answer positions), if that reproduces the model's own.
    probe = {k: v.to(accelerator.device) for k, v in collate(val_examples[:4], pad_id).items()}
    logits_mode = lora_eval.pick_logits_mode(accelerator.unwrap_model(model).get_base_model(), probe)
    head = accelerator.unwrap_model(model).get_output_embeddings()
    if logits_mode != "gather":
        say(f"note: {logits_mode} logits: this model's output is not a plain head(hidden states)")
    steps_per_epoch = math.ceil(len(train_loader) / cfg.gradient_accumulation_steps)
    total_steps = cfg.epochs * steps_per_epoch if cfg.max_steps is None else min(cfg.max_steps,
                                                                                 cfg.epochs * steps_per_epoch)
    # Stepped by hand once per optimizer step (not prepared): the step counts above are already per process.
    scheduler = get_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.warmup_steps,
                              num_training_steps=total_steps)
    accelerator.register_for_checkpointing(scheduler)
    clipper = GradClipper(cfg.clip, warmup_steps=cfg.warmup_steps)
    trainable_params = [p for p in model.parameters() if p.requires_grad]

    if main:
        out.mkdir(parents=True, exist_ok=True)
        ckpt.remove_partial_saves(out)
        write_run_info(out, cfg)
    logger = MetricsLogger(out, enabled=main)
    rouge_examples = val_examples[: cfg.eval_examples]
    sample_examples = val_examples[: cfg.num_samples]
    evaluate = partial(lora_eval.evaluate_adapter, accelerator=accelerator, tokenizer=tokenizer, val_loader=val_loader,
                       pad_id=pad_id, batch_size=cfg.eval_batch_size, max_new_tokens=cfg.max_new_tokens,
                       mode=logits_mode, head=head)

    # What must match between a checkpoint and its resume, or the data position means something else.
    layout = {"trainer": "lora", "base_model": cfg.base_model, "dataset": cfg.dataset,
              "train_examples": len(train_examples), "batch_size": cfg.batch_size,
              "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
              "num_processes": accelerator.num_processes, "seed": cfg.seed}
    step, start_epoch, skip_micro = 0, 0, 0
    if resume_path is None:
        say(f"evaluating the base model on {len(val_examples)} validation examples "
            f"(ROUGE-L on {len(rouge_examples)})...")
        before = evaluate(model, rouge_examples=rouge_examples)
        # val/* is the validation curve (step 0 = base model); eval/* are the before/after measurements.
        logger.log({"val/loss": before["val_loss"], "val/perplexity": before["val_perplexity"],
                    **{f"eval/{k}": v for k, v in before.items() if k != "generations"}}, 0)
        # The untrained adapter (B = 0) is the base model: it is the first candidate for "best".
        best_loss, best_step, bad_evals = before["val_loss"], 0, 0
        best_state = adapter_state(accelerator.unwrap_model(model))
    else:
        # adapter, optimizer, scheduler, RNG states
        saved = ckpt.load_checkpoint(accelerator, resume_path, layout, "model, data, batch sizes, processes and seed")
        step, start_epoch, skip_micro = saved["step"], saved["epoch"], saved["epoch_micro_batches"]
        before, best_loss, best_step, bad_evals = (saved["before"], saved["best_loss"], saved["best_step"],
                                                   saved["bad_evals"])
        clipper.load_state_dict(saved["clipper"])
        best_state = load_file(resume_path / BEST_ADAPTER_FILE)
        if skip_micro >= len(train_loader):
            start_epoch, skip_micro = start_epoch + 1, 0
        say(f"resumed from {resume_path} at step {step} (best validation loss {best_loss:.4f} at step {best_step})")
    if main:  # the adapter folder always holds the best adapter this run knows of
        current = adapter_state(accelerator.unwrap_model(model))
        set_peft_model_state_dict(accelerator.unwrap_model(model), best_state)
        save_adapter(accelerator.unwrap_model(model), cfg, out / "adapter", adapter_tokenizer)
        set_peft_model_state_dict(accelerator.unwrap_model(model), current)

    def save_checkpoint(epoch: int, epoch_micro: int) -> None:
        ckpt.save_checkpoint(accelerator, out, step, {
            "layout": layout, "step": step, "epoch": epoch, "epoch_micro_batches": epoch_micro, "before": before,
            "best_loss": best_loss, "best_step": best_step, "bad_evals": bad_evals, "clipper": clipper.state_dict(),
        }, cfg.keep_last, write_extra=lambda folder: save_file(best_state, folder / BEST_ADAPTER_FILE))

    stopped_early = False
    window_loss, window_micro, window_tokens = 0.0, 0, 0
    window_start = time.perf_counter()
    progress = tqdm(total=total_steps, initial=step, desc="lora", disable=not main, dynamic_ncols=True)
    model.train()
    for epoch in range(start_epoch, cfg.epochs):
        if step >= total_steps:
            break
        loader_seed.manual_seed(cfg.seed + epoch)  # each epoch's order depends on its index only: resumable
        batches = accelerator.skip_first_batches(train_loader, skip_micro) if skip_micro else train_loader
        epoch_micro, skip_micro = skip_micro, 0
        for batch in batches:
            epoch_micro += 1
            with accelerator.accumulate(model):
                logits, targets, _ = lora_eval.answer_logits(model, batch, logits_mode, head)
                loss = lora_eval.answer_loss(logits, targets, cfg.label_smoothing)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    max_norm = clipper.max_norm(step)
                    grad_norm = float(accelerator.clip_grad_norm_(trainable_params, max_norm or float("inf")))
                    clipper.observe(grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            window_loss += loss.item()
            window_micro += 1
            window_tokens += int(batch["attention_mask"].sum())
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            step += 1
            progress.update(1)

            if step % cfg.log_every == 0 or step == total_steps:
                stats = torch.tensor([window_loss, window_micro, window_tokens], dtype=torch.float64,
                                     device=accelerator.device)
                loss_sum, micro, tokens = accelerator.reduce(stats, reduction="sum").tolist()
                elapsed = time.perf_counter() - window_start
                scalars = {"train/loss": loss_sum / micro, "train/lr": scheduler.get_last_lr()[0],
                           "train/grad_norm": grad_norm, "train/tokens_per_sec": tokens / elapsed}
                logger.log(scalars, step)
                progress.set_postfix(loss=f"{scalars['train/loss']:.3f}", lr=f"{scalars['train/lr']:.2e}",
                                     tok_s=f"{scalars['train/tokens_per_sec']:.0f}")
                window_loss, window_micro, window_tokens, window_start = 0.0, 0, 0, time.perf_counter()

            paused = time.perf_counter()  # generation, evaluation and saving are not training throughput
            if step % cfg.sample_every == 0 and sample_examples:
                text = lora_eval.samples_markdown(accelerator, model, tokenizer, sample_examples, pad_id,
                                                  cfg.max_new_tokens)
                logger.text("samples", text, step)
                model.train()

            if step % cfg.eval_every == 0 or step == total_steps:
                val_loss = lora_eval.validation_loss(model, val_loader, accelerator, logits_mode, head)
                logger.log({"val/loss": val_loss, "val/perplexity": perplexity(val_loss)}, step)
                if val_loss < best_loss - cfg.min_delta:
                    best_loss, best_step, bad_evals = val_loss, step, 0
                    best_state = adapter_state(accelerator.unwrap_model(model))
                    if main:
                        save_adapter(accelerator.unwrap_model(model), cfg, out / "adapter", adapter_tokenizer)
                else:
                    bad_evals += 1
                progress.write(f"step {step}: val loss {val_loss:.4f} (best {best_loss:.4f} at step {best_step})")
                stopped_early = bad_evals >= cfg.patience
                model.train()
            if stopped_early or step >= total_steps:
                break
            if cfg.save_every and step % cfg.save_every == 0:
                save_checkpoint(epoch, epoch_micro)
            window_start += time.perf_counter() - paused
        if stopped_early:
            break
    progress.close()
    if stopped_early:
        say(f"early stop at step {step}: validation loss has not improved for {cfg.patience} evaluations")

    set_peft_model_state_dict(accelerator.unwrap_model(model), best_state)  # evaluate the adapter we keep
    say(f"evaluating the best adapter (step {best_step})...")
    after = evaluate(model, rouge_examples=rouge_examples)
    logger.log({f"eval/{k}": v for k, v in after.items() if k != "generations"}, step)
    logger.close()

    report = {
        "base_model": cfg.base_model, "dataset": cfg.dataset,
        "train_examples": len(train_examples), "val_examples": len(val_examples),
        "rouge_examples": len(rouge_examples), "steps": step, "best_step": best_step,
        "stopped_early": stopped_early, "trainable_params": trainable, "total_params": total,
        "before": {k: v for k, v in before.items() if k != "generations"},
        "after": {k: v for k, v in after.items() if k != "generations"},
        "examples": lora_eval.example_rows(rouge_examples, before["generations"], after["generations"]),
    }
    if main:
        from llmlab.core.io import atomic_write_json

        report["adapter_bytes"] = sum(f.stat().st_size for f in (out / "adapter").iterdir())
        atomic_write_json(out / "eval.json", report)
        print(lora_eval.before_after_table(report))
        print(f"adapter ({report['adapter_bytes'] / 1e6:.2f} MB): {out / 'adapter'}  eval: {out / 'eval.json'}")
    accelerator.wait_for_everyone()
    return report
