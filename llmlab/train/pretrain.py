"""GPT-2 pretraining with accelerate (optionally DeepSpeed ZeRO-2): the config and the training loop.

One readable loop in `train()`: gradient accumulation through `accelerator.accumulate`, mixed precision
and DeepSpeed through `accelerate launch`, a cosine schedule with warmup and a floor, checkpoints that
resume exactly, and loss-spike rollback (PaLM-style: reload the last checkpoint, lower the lr, skip the
data that caused the spike).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Literal, Optional

from llmlab.core.config import opt
from llmlab.data.prepare import DataConfig
from llmlab.core.errors import UserError
from llmlab.models.gpt2 import GPT2_PRESETS
from llmlab.train.spikes import parse_inject_spike
from llmlab.train.common import parse_clip

TINY_MAX_STEPS = 150  # gpt2-tiny defaults: 150 steps x 8 x 128 tokens take a few minutes on two CPU cores
TINY_BLOCK_SIZE = 128


@dataclass
class PretrainConfig(DataConfig):
    # model
    model: Literal["gpt2-tiny", "gpt2", "gpt2-medium"] = opt("gpt2-tiny", "GPT-2 preset to train from scratch")
    init_from: Optional[str] = opt(None, "start from this HF model name/path instead of a fresh preset")
    n_layer: Optional[int] = opt(None, "override the preset's number of layers (small test/sweep models)")
    n_embd: Optional[int] = opt(None, "override the preset's hidden size")
    n_head: Optional[int] = opt(None, "override the preset's attention heads")
    dropout: float = opt(0.0, "dropout of a fresh preset (0 is usual for pretraining; ignored with --init_from)")
    block_size: Optional[int] = opt(None, "tokens per training sequence; default: the model's context length "
                                          "(up to 1024); gpt2-tiny: 128")
    output_dir: str = opt("runs/pretrain", "run folder: checkpoints/, final/, tensorboard/, metrics.jsonl")
    # optimisation
    learning_rate: float = opt(6e-4, "peak AdamW learning rate")
    min_lr: float = opt(1e-5, "floor of the cosine decay")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.98, "AdamW beta2")
    adam_eps: float = opt(1e-6, "AdamW epsilon")
    weight_decay: float = opt(0.1, "AdamW weight decay (never on biases or LayerNorm weights)")
    warmup_steps: Optional[int] = opt(None, "linear warmup steps; default 2000, for gpt2-tiny 10%% of max_steps")
    max_steps: Optional[int] = opt(None, "optimizer steps to train; default: one pass over the training split, "
                                         f"for gpt2-tiny {TINY_MAX_STEPS}")
    batch_size: int = opt(8, "micro-batch: sequences per device per forward pass")
    effective_batch_size: Optional[int] = opt(None, "sequences per optimizer step (reached by gradient "
                                                    "accumulation); default 512, for gpt2-tiny = batch_size")
    clip: str = opt("1.0", "max grad norm, 0 = off, or 'adaptive' (1.5 x mean of the last 50 norms)")
    label_smoothing: float = opt(0.0, "label smoothing of the cross-entropy loss")
    mixed_precision: Optional[Literal["no", "bf16", "fp16"]] = opt(
        None, "no/bf16/fp16; default: what `accelerate launch` was configured with (else no)")
    gradient_checkpointing: bool = opt(False, "recompute activations in backward: less memory, ~30%% slower")
    seed: int = opt(42, "seed for python/numpy/torch (model init, data order, dropout)")
    # checkpoints and evaluation
    save_every: int = opt(500, "save a checkpoint every N optimizer steps")
    keep_last: int = opt(3, "keep only the newest N checkpoints")
    resume_from_checkpoint: Optional[str] = opt(None, "'latest' or a checkpoints/step_N folder to continue from")
    eval_every: int = opt(100, "validation loss every N steps (0 = only at the end)")
    eval_batches: int = opt(20, "validation micro-batches per evaluation")
    log_every: int = opt(1, "write train metrics every N steps")
    # loss-spike rollback
    spike_factor: float = opt(2.0, "a step spikes when its loss exceeds this x the mean of the last window")
    spike_window: int = opt(100, "steps in the reference mean of the spike detector")
    spike_patience: int = opt(10, "consecutive spiking steps that trigger a rollback")
    rollback_lr_factor: float = opt(0.8, "multiply the lr by this at each rollback")
    max_rollbacks: int = opt(5, "give up with an error after this many rollbacks")
    rollback_skip_data: bool = opt(True, "after a rollback, skip the batches seen since the checkpoint "
                                         "(the data window that caused the spike)")
    inject_spike: Optional[str] = opt(None, "drill: STEP[:FACTOR] multiplies the loss of `spike_patience` "
                                            "steps from STEP by FACTOR (default 10) to trigger a rollback")
    prepare_only: bool = opt(False, "only prepare (clean, tokenize, pack, cache) the dataset, print a summary")

    @property
    def is_tiny(self) -> bool:
        return self.init_from is None and self.model == "gpt2-tiny"

    def data_config(self) -> DataConfig:
        """The data part alone (what prepare_dataset hashes)."""
        from dataclasses import fields

        return DataConfig(**{f.name: getattr(self, f.name) for f in fields(DataConfig)})

    def validate(self) -> None:
        if self.block_size is None:
            self.block_size = TINY_BLOCK_SIZE if self.is_tiny else min(model_context_length(self), 1024)
        super().validate()
        if self.block_size > model_context_length(self):
            raise UserError(f"--block_size {self.block_size} exceeds the model's context length "
                            f"{model_context_length(self)}; lower --block_size")
        if self.prepare_only:
            return
        if self.batch_size < 1:
            raise UserError(f"--batch_size must be >= 1, got {self.batch_size}")
        if self.effective_batch_size is None:
            self.effective_batch_size = self.batch_size if self.is_tiny else 512
        if self.max_steps is not None and self.max_steps < 1:
            raise UserError(f"--max_steps must be >= 1, got {self.max_steps}")
        if self.is_tiny and self.max_steps is None:
            self.max_steps = TINY_MAX_STEPS
        if self.warmup_steps is None and (self.max_steps is not None or not self.is_tiny):
            self.warmup_steps = max(1, self.max_steps // 10) if self.is_tiny else 2000
        checks = [
            (self.learning_rate > 0, f"--learning_rate must be > 0, got {self.learning_rate}"),
            (0 <= self.min_lr <= self.learning_rate, f"--min_lr must be in [0, learning_rate], got {self.min_lr}"),
            (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1, "--adam_beta1/--adam_beta2 must be in [0, 1)"),
            (self.adam_eps > 0 and self.weight_decay >= 0, "--adam_eps must be > 0 and --weight_decay >= 0"),
            (self.effective_batch_size >= self.batch_size and self.effective_batch_size % self.batch_size == 0,
             f"--effective_batch_size ({self.effective_batch_size}) must be a multiple of --batch_size "
             f"({self.batch_size})"),
            (self.warmup_steps is None or self.warmup_steps >= 0, "--warmup_steps must be >= 0"),
            (0 <= self.label_smoothing < 1, f"--label_smoothing must be in [0, 1), got {self.label_smoothing}"),
            (0 <= self.dropout < 1, f"--dropout must be in [0, 1), got {self.dropout}"),
            (self.save_every >= 1 and self.keep_last >= 1, "--save_every and --keep_last must be >= 1"),
            (self.eval_every >= 0 and self.eval_batches >= 1 and self.log_every >= 1,
             "--eval_every must be >= 0, --eval_batches and --log_every >= 1"),
            (self.spike_factor > 1, f"--spike_factor must be > 1, got {self.spike_factor}"),
            (self.spike_window >= 1 and self.spike_patience >= 1, "--spike_window and --spike_patience must be >= 1"),
            (0 < self.rollback_lr_factor <= 1,
             f"--rollback_lr_factor must be in (0, 1], got {self.rollback_lr_factor}"),
            (self.max_rollbacks >= 0, f"--max_rollbacks must be >= 0, got {self.max_rollbacks}"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)
        parse_clip(self.clip)
        parse_inject_spike(self.inject_spike)


def model_context_length(cfg: PretrainConfig) -> int:
    if cfg.init_from is None:
        return GPT2_PRESETS[cfg.model]["n_positions"]
    from llmlab.models.gpt2 import context_length_of

    return context_length_of(cfg.init_from)


def resolved_for_run(cfg: PretrainConfig, train_blocks: int) -> PretrainConfig:
    """Fill the defaults that need the data (one pass over the training split)."""
    if cfg.max_steps is None:
        cfg = replace(cfg, max_steps=max(1, train_blocks // cfg.effective_batch_size))
    if cfg.warmup_steps >= cfg.max_steps:
        raise UserError(f"--warmup_steps ({cfg.warmup_steps}) must be below --max_steps ({cfg.max_steps})")
    return cfg


@dataclass
class TrainerState:
    """Everything besides model/optimizer/scheduler/scaler/RNG that an exact resume needs."""
    step: int = 0  # optimizer steps done
    micro_batches: int = 0  # data position: micro-batches each process has consumed
    tokens_seen: int = 0
    lr_scale: float = 1.0  # product of rollback_lr_factor over the rollbacks so far
    rollbacks: int = 0
    drill_done: bool = False


def _layout(cfg: PretrainConfig, accelerator, train_batches: int) -> dict:
    """What must not change between a checkpoint and its resume, or the data position means something else."""
    return {"batch_size": cfg.batch_size, "block_size": cfg.block_size, "num_processes": accelerator.num_processes,
            "gradient_accumulation_steps": accelerator.gradient_accumulation_steps, "train_batches": train_batches}


def train(cfg: PretrainConfig) -> dict:
    """Pretrain per `cfg`; returns a summary (steps, last validation loss, rollbacks, paths)."""
    import torch
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    from llmlab.train import checkpointing as ckpt
    from llmlab.data.prepare import prepare_dataset
    from llmlab.core.io import append_jsonl
    from llmlab.models.flops import current_device_name, mfu, peak_flops
    from llmlab.models.flops import flops_per_token
    from llmlab.train.pretrain_setup import (batch_stream, build_optimizer, build_pretrain_model, innermost_optimizer,
                                       loss_scale, make_accelerator, make_dataloaders, make_scheduler, save_final, validation_loss)
    from llmlab.core.runinfo import write_run_info
    from llmlab.train.spikes import SpikeDetector
    from llmlab.data.tokenizer import load_tokenizer
    from llmlab.core.tracking import MetricsLogger
    from llmlab.train.common import GradClipper, causal_lm_loss

    accelerator = make_accelerator(cfg)
    resume_path = None
    if cfg.resume_from_checkpoint:  # fail fast, before the data and model are built
        resume_path = ckpt.resolve_checkpoint(cfg.output_dir, cfg.resume_from_checkpoint)
        ckpt.read_trainer_state(resume_path)
    set_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.tokenizer)
    with accelerator.main_process_first():
        data = prepare_dataset(cfg.data_config(), tokenizer)
    world = accelerator.num_processes
    if cfg.effective_batch_size % (cfg.batch_size * world):
        raise UserError(f"--effective_batch_size {cfg.effective_batch_size} is not a multiple of --batch_size "
                        f"{cfg.batch_size} x {world} processes; change one of them")
    accelerator.gradient_accumulation_steps = cfg.effective_batch_size // (cfg.batch_size * world)
    cfg = resolved_for_run(cfg, len(data.train))

    model = build_pretrain_model(cfg, tokenizer)
    optimizer = build_optimizer(cfg, model)
    train_dl, val_dl = make_dataloaders(cfg, data)
    try:
        model, optimizer, train_dl, val_dl = accelerator.prepare(model, optimizer, train_dl, val_dl)
    except ValueError as err:  # DeepSpeed refuses a precision the device lacks
        raise UserError(f"cannot prepare the model for this device ({str(err).splitlines()[0][:160]}); "
                        "on CPU use --mixed_precision bf16 or no") from None
    scheduler = make_scheduler(cfg, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    if len(train_dl) < accelerator.gradient_accumulation_steps:
        raise UserError(f"the training split has only {len(train_dl)} batches per process, fewer than one "
                        "optimizer step; use more data or a smaller --effective_batch_size")

    out = ckpt.checkpoints_dir(cfg.output_dir).parent
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        ckpt.remove_partial_saves(out)
        write_run_info(out, cfg)
    logger = MetricsLogger(out, enabled=accelerator.is_main_process)
    state = TrainerState()
    clipper = GradClipper(cfg.clip, warmup_steps=cfg.warmup_steps)
    detector = SpikeDetector(cfg.spike_factor, cfg.spike_window, cfg.spike_patience)
    drill = parse_inject_spike(cfg.inject_spike)
    layout = _layout(cfg, accelerator, len(train_dl))

    def restore(path) -> None:
        nonlocal state
        saved = ckpt.load_checkpoint(accelerator, path, layout, "batch size, block size, processes and data")
        state = TrainerState(**saved["trainer"])
        detector.load_state_dict(saved["spike_detector"])
        clipper.load_state_dict(saved["clipper"])

    if resume_path is not None:
        restore(resume_path)
        accelerator.print(f"resumed from {resume_path} at step {state.step}")

    def save() -> None:
        ckpt.save_checkpoint(accelerator, out, state.step, {
            "trainer": vars(state).copy(), "spike_detector": detector.state_dict(),
            "clipper": clipper.state_dict(), "layout": layout}, cfg.keep_last)

    def rollback(loss: float) -> None:
        nonlocal batches
        path = ckpt.latest_checkpoint(out)
        spike_step, position, before = state.step, state.micro_batches, state
        if path is None:
            raise UserError(f"loss spike at step {spike_step} (loss {loss:.4g}) but no checkpoint to roll back "
                            "to yet; lower --save_every or --learning_rate")
        if before.rollbacks >= cfg.max_rollbacks:
            event = {"event": "gave_up", "step": spike_step, "loss": loss, "rollbacks": before.rollbacks}
            if accelerator.is_main_process:
                append_jsonl(out / "events.jsonl", {"time": time.time(), **event})
            raise UserError(f"loss kept spiking (step {spike_step}, loss {loss:.4g}) after {before.rollbacks} "
                            "rollbacks (--max_rollbacks); lower --learning_rate or --clip, or check the data")
        restore(path)
        skipped = position - state.micro_batches if cfg.rollback_skip_data else 0
        state.rollbacks, state.drill_done = before.rollbacks + 1, before.drill_done
        state.lr_scale = before.lr_scale * cfg.rollback_lr_factor
        if cfg.rollback_skip_data:
            state.micro_batches = position
        scheduler.base_lrs = [cfg.learning_rate * state.lr_scale for _ in scheduler.base_lrs]
        for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * fn(scheduler.last_epoch)
        scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
        batches = batch_stream(accelerator, train_dl, state.micro_batches)
        event = {"event": "rollback", "step": spike_step, "loss": loss, "to_checkpoint": str(path),
                 "resumed_step": state.step, "rollbacks": state.rollbacks, "lr_scale": state.lr_scale,
                 "skipped_micro_batches": skipped}
        if accelerator.is_main_process:
            append_jsonl(out / "events.jsonl", {"time": time.time(), **event})
            logger.text("events/rollback", str(event), spike_step)
            logger.log({"train/rollbacks": state.rollbacks}, spike_step)
        accelerator.print(f"loss spike at step {spike_step}: rolled back to {path.name}, lr x {state.lr_scale:.3g}")
        detector.streak = 0

    tokens_per_step = cfg.effective_batch_size * cfg.block_size
    accelerator.print(
        f"model {cfg.init_from or cfg.model}: {accelerator.unwrap_model(model).num_parameters() / 1e6:.1f}M params; "
        f"{cfg.max_steps} steps of {cfg.effective_batch_size} x {cfg.block_size} tokens "
        f"({cfg.batch_size}/device x {accelerator.gradient_accumulation_steps} accumulation x {world} processes); "
        f"precision {accelerator.mixed_precision}; optimizer {type(innermost_optimizer(optimizer)).__name__}; "
        f"{accelerator.distributed_type.value}")
    flops_token = flops_per_token(accelerator.unwrap_model(model), cfg.block_size)
    peak = peak_flops(current_device_name(), accelerator.mixed_precision)
    batches = batch_stream(accelerator, train_dl, state.micro_batches)
    bar = tqdm(total=cfg.max_steps, initial=state.step, disable=not accelerator.is_local_main_process,
               desc="pretrain", dynamic_ncols=True)
    last_val = None
    pending_save = False
    model.train()
    tick = time.perf_counter()
    try:
        while state.step < cfg.max_steps:
            this_step = state.step + 1
            drill_factor = 1.0
            if drill and not state.drill_done and drill[0] <= this_step < drill[0] + cfg.spike_patience:
                drill_factor = drill[1]
                state.drill_done = this_step == drill[0] + cfg.spike_patience - 1
            lr = optimizer.param_groups[0]["lr"]
            losses, grad_norm = [], None
            for _ in range(accelerator.gradient_accumulation_steps):
                batch = next(batches)
                state.micro_batches += 1
                with accelerator.accumulate(model):
                    input_ids = batch["input_ids"]
                    loss = causal_lm_loss(model(input_ids=input_ids).logits, input_ids, cfg.label_smoothing)
                    loss = loss * drill_factor
                    accelerator.backward(loss)
                    losses.append(loss.detach())
                    if accelerator.sync_gradients:
                        max_norm = clipper.max_norm(state.step)
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm or float("inf"))
                        finite = bool(torch.isfinite(torch.stack(losses)).all())
                        if finite:  # a NaN/inf loss must not reach the weights; it counts as a spike below
                            optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            state.step = this_step
            state.tokens_seen += tokens_per_step
            step_loss = accelerator.reduce(torch.stack(losses).mean(), reduction="mean").item()
            grad_norm = float(grad_norm) if grad_norm is not None else None
            if grad_norm is not None:
                clipper.observe(grad_norm)
            now = time.perf_counter()
            tokens_per_sec = tokens_per_step / max(now - tick, 1e-9)
            tick = now

            if detector.update(step_loss):
                rollback(step_loss)
                pending_save, tick = False, time.perf_counter()
                continue
            if state.step % cfg.log_every == 0 or state.step == cfg.max_steps:
                metrics = {"train/loss": step_loss, "train/lr": lr, "train/grad_norm": grad_norm,
                           "train/tokens_per_sec": tokens_per_sec, "train/tokens_seen": state.tokens_seen,
                           "train/loss_scale": loss_scale(accelerator, optimizer),
                           "train/mfu": mfu(tokens_per_sec, flops_token, peak, world)}
                logger.log({k: v for k, v in metrics.items() if v is not None}, state.step)
            bar.update(1)
            bar.set_postfix(loss=f"{step_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_sec:,.0f}")

            paused = False  # evaluation and saving are not training time: keep them out of tokens/s
            if len(val_dl) and ((cfg.eval_every and state.step % cfg.eval_every == 0) or state.step == cfg.max_steps):
                last_val = validation_loss(accelerator, model, val_dl, cfg.eval_batches)
                logger.log({"val/loss": last_val, "val/perplexity": math.exp(min(last_val, 50))}, state.step)
                model.train()
                paused = True
            pending_save = pending_save or state.step % cfg.save_every == 0
            if pending_save and detector.streak == 0:  # never save in the middle of a spike
                save()
                pending_save, paused = False, True
            if paused:
                tick = time.perf_counter()

    finally:  # close the bar first, so an error message starts on its own line
        bar.close()
        logger.flush()
    final_dir = save_final(accelerator, model, tokenizer, out)
    logger.close()
    return {"step": state.step, "val_loss": last_val,
            "rollbacks": state.rollbacks, "final_dir": str(final_dir), "output_dir": str(out)}
