"""LoRA domain adaptation: config, base model + adapter, and the training loop behind train_lora.py.

One readable loop under accelerate (CPU, one GPU or several): prompt-masked loss on the answer tokens,
AdamW + linear warmup/decay, early stopping on validation loss that keeps the best adapter, and a
before/after evaluation (validation perplexity and ROUGE-L of greedy answers, see llmlab.lora_eval).
"""
from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal, Optional

from llmlab.config import opt
from llmlab.errors import UserError
from llmlab.instruct_data import DEFAULT_PROMPT, DEFAULT_PROMPT_NO_INPUT, check_templates
from llmlab.io import llmlab_cache

DEFAULT_BASE_MODEL = "runs/pretrain/final"
PROMPT_FILE = "llmlab_prompt.json"  # saved next to the adapter so inference formats prompts the same way


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
    seed: int = opt(0, "seed for LoRA init, dropout and shuffling")
    output_dir: str = opt("runs/lora", "run folder: adapter/, eval.json, config.yaml, tensorboard/")

    def validate(self) -> None:
        positive = ("max_length", "lora_r", "batch_size", "gradient_accumulation_steps", "epochs", "eval_every",
                    "patience", "eval_batch_size", "max_new_tokens", "sample_every", "log_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "max_examples"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UserError(f"--{name} must be >= 1 (or omitted), got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_examples", "num_samples"):
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
        from llmlab.training_utils import parse_clip

        parse_clip(self.clip)
        check_templates(self.prompt_template, self.prompt_template_no_input)


# --------------------------------------------------------------------------------------------------
# Base model, tokenizer, adapter
# --------------------------------------------------------------------------------------------------

def check_base_model(cfg: LoraTrainConfig) -> None:
    if cfg.base_model == DEFAULT_BASE_MODEL and not Path(cfg.base_model).is_dir():
        raise UserError(f"no pretrained model at {DEFAULT_BASE_MODEL}: run `accelerate launch train_pretrain.py` "
                        "first, or pass --base_model (any Hugging Face model name or save_pretrained folder)")
    # Hub names never start like a path; a missing local folder need not wait for the hub lookup.
    if cfg.base_model.startswith(("/", ".", "~")) and not Path(cfg.base_model).expanduser().exists():
        raise UserError(f"cannot load --base_model {cfg.base_model!r} (no such folder); pass a save_pretrained "
                        "folder or a Hugging Face model name")


def quiet_optional_backends() -> None:
    """peft imports torchao and bitsandbytes, whose missing optional kernels log warnings at import time."""
    import logging

    for name in ("torchao", "bitsandbytes", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def load_base(cfg: LoraTrainConfig):
    """(model, tokenizer, whether the tokenizer came from the base model's folder).

    A missing default model is a one-line hint, not a traceback."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmlab.tokenizer import load_tokenizer

    check_base_model(cfg)
    try:
        model = AutoModelForCausalLM.from_pretrained(cfg.base_model)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load --base_model {cfg.base_model!r} ({str(err).strip().splitlines()[0][:160]}); "
                        "pass a save_pretrained folder, or a hub name when online") from None
    from_base = False
    if cfg.tokenizer:
        tokenizer = load_tokenizer(cfg.tokenizer)
    else:
        try:
            tokenizer, from_base = AutoTokenizer.from_pretrained(cfg.base_model), True
        except (OSError, ValueError, TypeError):
            if model.config.vocab_size != 50257:
                raise UserError(f"--base_model {cfg.base_model!r} has no tokenizer files; pass --tokenizer") from None
            tokenizer = load_tokenizer()  # a GPT-2-vocab model saved without its tokenizer
    if tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has no eos token; answers need one to teach the model to stop")
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        raise UserError(f"tokenizer has {len(tokenizer)} tokens but the model only {model.config.vocab_size}; "
                        "pass the model's own tokenizer with --tokenizer")
    return model, tokenizer, from_base


def add_lora(model, cfg: LoraTrainConfig):
    """Wrap `model` with a LoRA adapter; afterwards only adapter weights require grad."""
    from peft import LoraConfig, get_peft_model

    if cfg.gradient_checkpointing:
        # Frozen embeddings would give the checkpointed blocks inputs without grad, and no grad would
        # reach the adapters inside them: make the embedding output require grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        model.config.use_cache = False
    # peft notices GPT-2's Conv1D layers itself (sets fan_in_fan_out) and says so; transformers 5 warns
    # about an attribute peft still reads. Neither is actionable by the user.
    warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False")
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    lora_config = LoraConfig(task_type="CAUSAL_LM", r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                             lora_dropout=cfg.lora_dropout, target_modules=cfg.target_modules)
    try:
        return get_peft_model(model, lora_config)
    except ValueError as err:  # unknown model type without --target_modules, or names that match nothing
        raise UserError(f"cannot place LoRA adapters ({str(err).strip().splitlines()[0][:160]}); "
                        "set --target_modules to the attention projections of this model") from None


def parameter_counts(model) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def adapter_state(model) -> dict:
    """A CPU copy of the adapter weights (kept in memory as the best-so-far adapter)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(model).items()}


def save_adapter(model, cfg: LoraTrainConfig, path: Path, tokenizer=None) -> None:
    """peft save_pretrained into a temp folder, then swapped into place: never a half-written adapter.

    `tokenizer` is saved alongside only when it is not the base model's own (which inference finds there).
    """
    from llmlab.io import atomic_write_json, publish_dir

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    atomic_write_json(tmp / PROMPT_FILE, {"prompt_template": cfg.prompt_template,
                                          "prompt_template_no_input": cfg.prompt_template_no_input,
                                          "eos_after_answer": True})
    publish_dir(tmp, path)


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------

def make_accelerator(cfg: LoraTrainConfig):
    from accelerate import Accelerator

    from llmlab.training_utils import process_group_handlers

    return Accelerator(gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                       kwargs_handlers=process_group_handlers())


def train(cfg: LoraTrainConfig) -> dict:
    """Adapt, evaluate before and after, save the best adapter; returns the eval.json content."""
    check_base_model(cfg)  # before the slow imports: the most common first-run mistake answers at once
    quiet_optional_backends()
    import torch
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    from llmlab import lora_eval
    from llmlab.instruct_data import collate, load_records, pad_id_for, split_records, tokenize_records
    from llmlab.models import context_length
    from llmlab.runinfo import write_run_info
    from llmlab.tracking import MetricsLogger
    from llmlab.training_utils import GradClipper

    out = Path(cfg.output_dir)
    model, tokenizer, tokenizer_from_base = load_base(cfg)
    accelerator = make_accelerator(cfg)
    main = accelerator.is_main_process
    say = accelerator.print
    set_seed(cfg.seed)

    records = load_records(cfg.dataset, cfg.cache_dir, cfg.dataset_config, cfg.dataset_split)
    train_records, val_records = split_records(records, cfg.val_fraction, cfg.data_seed, cfg.max_examples)
    max_length = min(cfg.max_length, context_length(model))
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
    trainable, total = parameter_counts(model)
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
    clipper = GradClipper(cfg.clip, warmup_steps=cfg.warmup_steps)
    trainable_params = [p for p in model.parameters() if p.requires_grad]

    if main:
        out.mkdir(parents=True, exist_ok=True)
        write_run_info(out, cfg)
    logger = MetricsLogger(out, enabled=main)
    rouge_examples = val_examples[: cfg.eval_examples]
    sample_examples = val_examples[: cfg.num_samples]
    evaluate = partial(lora_eval.evaluate, accelerator=accelerator, tokenizer=tokenizer, val_loader=val_loader,
                       pad_id=pad_id, batch_size=cfg.eval_batch_size, max_new_tokens=cfg.max_new_tokens,
                       mode=logits_mode, head=head)

    say(f"evaluating the base model on {len(val_examples)} validation examples "
        f"(ROUGE-L on {len(rouge_examples)})...")
    before = evaluate(model, rouge_examples=rouge_examples)
    # val/* is the validation curve (step 0 = base model); eval/* are the before/after measurements.
    logger.log({"val/loss": before["val_loss"], "val/perplexity": before["val_perplexity"],
                **{f"eval/{k}": v for k, v in before.items() if k != "generations"}}, 0)
    # The untrained adapter (B = 0) is the base model: it is the first candidate for "best".
    best_loss, best_step, bad_evals, stopped_early = before["val_loss"], 0, 0, False
    best_state = adapter_state(accelerator.unwrap_model(model))
    if main:
        save_adapter(accelerator.unwrap_model(model), cfg, out / "adapter", adapter_tokenizer)

    step, window_loss, window_micro, window_tokens = 0, 0.0, 0, 0
    window_start = time.perf_counter()
    progress = tqdm(total=total_steps, desc="lora", disable=not main, dynamic_ncols=True)
    model.train()
    for _epoch in range(cfg.epochs):
        for batch in train_loader:
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

            paused = time.perf_counter()  # generation and evaluation time is not training throughput
            if step % cfg.sample_every == 0 and sample_examples:
                text = lora_eval.samples_markdown(accelerator, model, tokenizer, sample_examples, pad_id,
                                                  cfg.max_new_tokens)
                logger.text("samples", text, step)
                model.train()

            if step % cfg.eval_every == 0 or step == total_steps:
                val_loss = lora_eval.validation_loss(model, val_loader, accelerator, logits_mode, head)
                logger.log({"val/loss": val_loss, "val/perplexity": lora_eval.perplexity(val_loss)}, step)
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
            window_start += time.perf_counter() - paused
            if stopped_early or step >= total_steps:
                break
        if stopped_early or step >= total_steps:
            break
    progress.close()
    if stopped_early:
        say(f"early stop at step {step}: validation loss has not improved for {cfg.patience} evaluations")

    from peft import set_peft_model_state_dict

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
        from llmlab.io import atomic_write_json

        report["adapter_bytes"] = sum(f.stat().st_size for f in (out / "adapter").iterdir())
        atomic_write_json(out / "eval.json", report)
        print(lora_eval.before_after_table(report))
        print(f"adapter ({report['adapter_bytes'] / 1e6:.2f} MB): {out / 'adapter'}  eval: {out / 'eval.json'}")
    accelerator.wait_for_everyone()
    return report
