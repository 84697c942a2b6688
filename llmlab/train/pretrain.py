"""GPT-2 pretraining with accelerate (optionally DeepSpeed ZeRO-2): the config and the training loop.

One readable loop in `train()`: gradient accumulation through `accelerator.accumulate`, mixed precision
and DeepSpeed through `accelerate launch`, a cosine schedule with warmup and a floor, checkpoints that
resume exactly, and loss-spike rollback (PaLM-style: reload the last checkpoint, lower the lr, skip the
data that caused the spike).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, Optional

from llmlab.core.config import opt
from llmlab.data.prepare import DataConfig
from llmlab.core.errors import UserError
from llmlab.models.gpt2 import GPT2_PRESETS
from llmlab.train.spikes import parse_inject_spike
from llmlab.train.common import parse_clip

# gpt2-tiny's recipe: about four minutes on two CPU cores (bench/quickstart.py measures it against the old one).
# bf16 autocast and the chunked loss run ~1.25x the old fp32 tokens/s end to end, so 190 steps fit the wall time of
# the old 150; lr 2e-3 was the best of the peak lrs tried at this length (docs/findings/README.md).
TINY_MAX_STEPS = 190
TINY_LEARNING_RATE = 2e-3
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
    overwrite_output_dir: bool = opt(False, "start afresh in an --output_dir that already holds a run (deletes that "
                                            "run's checkpoints/, final/ and logs, nothing else)")
    report_to: list[str] = opt(["tensorboard"], "trackers: tensorboard, wandb, mlflow, aim, comet_ml, all or none "
                                                "(metrics.jsonl is always written)")
    # optimisation
    optimizer: Literal["adamw", "lion", "adafactor"] = opt("adamw", "adamw, lion (takes lr / 3 and weight decay x 3 "
                                                                   "of the values given: llmlab.train.optim) or "
                                                                   "adafactor (fixed lr)")
    learning_rate: Optional[float] = opt(None, f"peak learning rate; default 6e-4, for gpt2-tiny "
                                               f"{TINY_LEARNING_RATE:g}")
    lr_scheduler: Literal["linear", "cosine", "polynomial", "constant"] = opt(
        "cosine", "decay after the linear warmup, down to --min_lr (polynomial: power 2)")
    min_lr: float = opt(1e-5, "floor of the decay")
    adam_beta1: float = opt(0.9, "beta1 of AdamW and Lion")
    adam_beta2: float = opt(0.98, "beta2 of AdamW and Lion")
    adam_eps: float = opt(1e-6, "AdamW epsilon")
    weight_decay: float = opt(0.1, "weight decay (matrices only: never biases or LayerNorm weights)")
    warmup_steps: Optional[int] = opt(None, "linear warmup steps; default 2000, for gpt2-tiny 10%% of max_steps")
    max_steps: Optional[int] = opt(None, "optimizer steps to train; default: one pass over the training split, "
                                         f"for gpt2-tiny {TINY_MAX_STEPS}")
    batch_size: int = opt(8, "micro-batch: sequences per device per forward pass")
    effective_batch_size: Optional[int] = opt(None, "sequences per optimizer step (reached by gradient "
                                                    "accumulation); default 512, for gpt2-tiny = batch_size")
    clip: str = opt("1.0", "max grad norm, 0 = off, or 'adaptive' (1.5 x mean of the last 50 norms)")
    clip_mode: Literal["norm", "value"] = opt("norm", "clip the global gradient norm, or clamp every gradient "
                                                      "element to [-clip, clip]")
    label_smoothing: float = opt(0.0, "label smoothing of the cross-entropy loss")
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = opt(
        "auto", "auto = the `accelerate launch` config's bf16/fp16 if it sets one, else bf16 autocast where the "
                "hardware has bf16 units (AVX512-BF16/AMX CPUs, Ampere+ GPUs), fp16 on older GPUs, else no")
    compile: bool = opt(False, "torch.compile the transformer body (a one-off 30-90 s on a CPU, then faster steps; "
                               "bench/pretrain_throughput.py measures it)")
    gradient_checkpointing: bool = opt(False, "recompute activations in backward: less memory, ~30%% slower")
    loss_chunk_tokens: int = opt(1024, "compute the output layer + loss in chunks of this many tokens, so the "
                                       "[tokens x vocab] logits never exist whole (0 = the model's full logits)")
    seed: int = opt(42, "seed for python/numpy/torch (model init, data order, dropout)")
    cpu_threads: int = opt(0, "CPU threads per process; 0 = PyTorch's default, or all cores when `accelerate "
                              "launch` forced OMP_NUM_THREADS=1")
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
    spike_arm_steps: int = opt(20, "normal steps after which the detector arms (before its window is full)")
    rollback_lr_factor: float = opt(0.8, "multiply the lr by this at each rollback")
    max_rollbacks: int = opt(5, "give up with an error after this many rollbacks")
    rollback_skip_data: bool = opt(True, "after a rollback, skip the batches seen since the checkpoint "
                                         "(the data window that caused the spike)")
    inject_spike: Optional[str] = opt(None, "drill: STEP[:FACTOR] multiplies the loss of `spike_patience` "
                                            "steps from STEP by FACTOR (default 10) to trigger a rollback")
    prepare_only: bool = opt(False, "only prepare (clean, tokenize, pack, cache) the dataset, print a summary")
    sample_prompts: list[str] = opt(["The history of", "In mathematics,"], "prompts the final model continues "
                                    "(greedy) at the end, so you can read what it learned; empty = none")
    sample_tokens: int = opt(24, "new tokens per final sample")

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
        if self.learning_rate is None:
            self.learning_rate = TINY_LEARNING_RATE if self.is_tiny else 6e-4
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
            (self.spike_window >= 1 and self.spike_patience >= 1 and self.spike_arm_steps >= 1,
             "--spike_window, --spike_patience and --spike_arm_steps must be >= 1"),
            (0 < self.rollback_lr_factor <= 1,
             f"--rollback_lr_factor must be in (0, 1], got {self.rollback_lr_factor}"),
            (self.max_rollbacks >= 0, f"--max_rollbacks must be >= 0, got {self.max_rollbacks}"),
            (self.cpu_threads >= 0, f"--cpu_threads must be >= 0 (0 = automatic), got {self.cpu_threads}"),
            (self.loss_chunk_tokens >= 0, f"--loss_chunk_tokens must be >= 0, got {self.loss_chunk_tokens}"),
            (self.sample_tokens >= 0, f"--sample_tokens must be >= 0, got {self.sample_tokens}"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)
        parse_clip(self.clip)
        from llmlab.core.tracking import check_report_to
        from llmlab.train.spikes import check_drill

        check_drill(parse_inject_spike(self.inject_spike), self.save_every, min(self.spike_arm_steps, self.spike_window))

        check_report_to(self.report_to)


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


# Files a pretraining run writes into --output_dir: their presence means the folder holds a run.
RUN_FILES = ("checkpoints", "final", "metrics.jsonl", "events.jsonl", "tensorboard", "config.yaml", "run_info.json")
# Options a resume may change: the schedule's length and lr are recomputed from them at the resumed step, the
# rest are cadences and safety nets. Anything else (model, data, batch, precision, seed, ...) is refused.
RESUMABLE = ("max_steps", "learning_rate", "min_lr", "warmup_steps", "eval_every", "eval_batches", "log_every",
             "save_every", "keep_last", "spike_factor", "spike_window", "spike_patience", "spike_arm_steps",
             "rollback_lr_factor", "max_rollbacks", "rollback_skip_data", "inject_spike", "gradient_checkpointing",
             "clip", "loss_chunk_tokens", "compile", "sample_prompts", "sample_tokens")


def train(cfg: PretrainConfig) -> dict:
    """Pretrain per `cfg`; returns a summary (steps, last validation loss, rollbacks, paths)."""
    from llmlab.train.loop import TrainingSession, resolve_mixed_precision
    from llmlab.train.pretrain_setup import accumulation_plugin, check_deepspeed

    session = TrainingSession(cfg, "pretraining", run_files=RUN_FILES, resumable=RESUMABLE,
                              mixed_precision=resolve_mixed_precision(cfg.mixed_precision),
                              gradient_accumulation_plugin=accumulation_plugin())
    check_deepspeed(session.accelerator, cfg)
    with session:
        return Pretraining(cfg, session).run()


class Pretraining:
    """The pretraining run on top of the shared session: data, GPT-2, AdamW + cosine, and spike rollback."""

    def __init__(self, cfg: PretrainConfig, session):
        from accelerate.utils import set_seed

        from llmlab.data.prepare import prepare_dataset
        from llmlab.data.tokenizer import load_tokenizer
        from llmlab.train import pretrain_setup as setup
        from llmlab.train.common import GradClipper
        from llmlab.train.spikes import RollbackState, SpikeDetector

        self.session, acc = session, session.accelerator
        set_seed(cfg.seed)
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        with acc.main_process_first():
            data = prepare_dataset(cfg.data_config(), self.tokenizer)
        self.data_id = data.cache_path.name  # names the data's content and preparation: a resume checks it
        acc.gradient_accumulation_steps = setup.accumulation_steps(cfg, acc.num_processes)
        self.cfg = cfg = resolved_for_run(cfg, len(data.train))
        session.cfg = cfg
        from llmlab.train.fused_loss import CausalLMWithLoss

        model = CausalLMWithLoss(setup.build_pretrain_model(cfg, self.tokenizer), cfg.label_smoothing,
                                 cfg.loss_chunk_tokens)
        if cfg.compile:  # the body only, in place (state-dict keys unchanged); the chunked loss stays eager
            model.model.base_model.compile()
        optimizer = setup.build_optimizer(cfg, model)
        train_dl, self.val_dl = setup.make_dataloaders(cfg, data)
        # validation stays unsharded (pretrain_setup.validation_loss): the same tokens at any world size
        self.model, self.optimizer, self.train_dl = session.prepare(model, optimizer, train_dl)
        self.scheduler = setup.make_scheduler(cfg, self.optimizer, session.state)
        self.clipper = GradClipper(cfg.clip, warmup_steps=cfg.warmup_steps, clip_mode=cfg.clip_mode)
        self.detector = SpikeDetector(cfg.spike_factor, cfg.spike_window, cfg.spike_patience, cfg.spike_arm_steps)
        self.rollbacks = RollbackState()
        self.drill = parse_inject_spike(cfg.inject_spike)
        session.register(self.scheduler, self.clipper, self.detector, self.rollbacks)
        setup.check_data_size(self.train_dl, acc)
        layout = {"batch_size": cfg.batch_size, "block_size": cfg.block_size, "num_processes": acc.num_processes,
                  "gradient_accumulation_steps": acc.gradient_accumulation_steps, "train_batches": len(self.train_dl),
                  "data": self.data_id}
        session.begin(cfg.max_steps, layout, cfg.save_every, cfg.keep_last, model=self.model, desc="pretrain",
                      extra_manifest=lambda: self.rollbacks.state_dict())
        session.refresh_lr(self.scheduler, cfg.learning_rate)  # a resume honours a changed --learning_rate
        self.describe()

    def describe(self) -> None:
        from llmlab.models.flops import current_device_name, flops_per_token, peak_flops
        from llmlab.train.pretrain_setup import innermost_optimizer

        cfg, acc, session = self.cfg, self.session.accelerator, self.session
        unwrapped = acc.unwrap_model(self.model).model
        acc.print(f"model {cfg.init_from or cfg.model}: {unwrapped.num_parameters() / 1e6:.1f}M params; "
                  f"{cfg.max_steps} steps of {cfg.effective_batch_size} x {cfg.block_size} tokens "
                  f"({cfg.batch_size}/device x {acc.gradient_accumulation_steps} accumulation x {acc.num_processes} "
                  f"processes); precision {acc.mixed_precision}; optimizer "
                  f"{type(innermost_optimizer(self.optimizer)).__name__}, {cfg.lr_scheduler} schedule; "
                  f"{acc.distributed_type.value}")
        session.flops_per_token = flops_per_token(unwrapped, cfg.block_size)
        session.peak_flops = peak_flops(current_device_name(), acc.mixed_precision)

    def run(self) -> dict:
        """The loop: one optimizer step per iteration, read top to bottom."""
        from llmlab.train.pretrain_setup import batch_stream

        cfg, session, acc, state = self.cfg, self.session, self.session.accelerator, self.session.state
        self.batches = batch_stream(acc, self.train_dl, state.micro_batches)
        last_val = last_loss = None
        self.model.train()
        while state.step < cfg.max_steps:
            result = self.train_step(self.drill_factor(state.step + 1))
            last_loss = result.loss
            if self.detector.update(result.loss):
                self.rollback(result.loss)
                continue
            session.log_step(result, cfg.log_every, {"train/loss_scale": self.loss_scale()})
            if len(self.val_dl) and session.due(cfg.eval_every):
                with session.paused():
                    last_val = self.evaluate()
            session.checkpointer.maybe_save(state.step, allowed=self.detector.streak == 0)  # never mid-spike
        if last_val is None and len(self.val_dl):  # e.g. resumed at the last step: measure before publishing
            with session.paused():
                last_val = self.evaluate()
        final_loss = last_val if last_val is not None else last_loss
        if final_loss is not None and not math.isfinite(final_loss):
            raise UserError(f"the run ended with loss {final_loss}: not publishing a broken model; lower "
                            "--learning_rate and resume from the last good checkpoint")
        final_dir = self.save_final()
        samples = self.final_samples()
        return {"samples": samples, "step": state.step, "val_loss": last_val, "rollbacks": self.rollbacks.rollbacks,
                "final_dir": str(final_dir), "output_dir": str(session.out)}

    def train_step(self, drill_factor: float):
        acc, session = self.session.accelerator, self.session
        for _ in range(acc.gradient_accumulation_steps):
            input_ids = next(self.batches)["input_ids"]
            with acc.accumulate(self.model):
                loss = self.model(input_ids)  # the chunked head + cross-entropy (llmlab.train.fused_loss)
                session.backward(loss * drill_factor, input_ids.numel())
                if acc.sync_gradients:
                    result = session.optimizer_step(self.model.parameters(), self.optimizer, self.scheduler,
                                                    self.clipper)
        return result

    def drill_factor(self, step: int) -> float:
        """--inject_spike: multiply the loss of `spike_patience` steps from STEP, once."""
        if not self.drill or self.rollbacks.drill_done or not self.drill[0] <= step < self.drill[0] + self.cfg.spike_patience:
            return 1.0
        self.rollbacks.drill_done = step == self.drill[0] + self.cfg.spike_patience - 1
        return self.drill[1]

    def evaluate(self) -> float:
        from llmlab.train.common import perplexity
        from llmlab.train.pretrain_setup import pretrain_validation_loss

        loss = pretrain_validation_loss(self.session.accelerator, self.model, self.val_dl, self.cfg.eval_batches)
        self.session.log({"val/loss": loss, "val/perplexity": perplexity(loss)})
        self.model.train()
        return loss

    def rollback(self, loss: float) -> None:
        """PaLM-style: back to the newest good checkpoint, lr x rollback_lr_factor, skip the data that spiked."""
        from llmlab.train import checkpointing as ckpt
        from llmlab.train.pretrain_setup import batch_stream

        cfg, session, state = self.cfg, self.session, self.session.state
        spike_step, position, before = state.step, state.micro_batches, self.rollbacks.state_dict()
        scale = state.lr_scale * cfg.rollback_lr_factor
        path, _ = ckpt.newest_good_checkpoint(session.out)
        if path is None:
            raise UserError(f"loss spike at step {spike_step} (loss {loss:.4g}) but no checkpoint to roll back "
                            "to yet; lower --save_every or --learning_rate")
        if before["rollbacks"] >= cfg.max_rollbacks:
            self.event({"event": "gave_up", "step": spike_step, "loss": loss, "rollbacks": before["rollbacks"],
                        "checkpoint": str(path)}, spike_step)
            raise UserError(f"loss kept spiking (step {spike_step}, loss {loss:.4g}) after {before['rollbacks']} "
                            f"rollbacks to {path.name} (--max_rollbacks); if it spikes right after every rollback "
                            "the checkpoint or the data is at fault, else lower --learning_rate or --clip")
        ckpt.load_checkpoint(session.accelerator, path)
        skipped = position - state.micro_batches if cfg.rollback_skip_data else 0
        self.rollbacks.load_state_dict({**before, "rollbacks": before["rollbacks"] + 1})
        state.lr_scale = scale
        if cfg.rollback_skip_data:
            state.micro_batches = position
        session.refresh_lr(self.scheduler, cfg.learning_rate)
        self.batches = batch_stream(session.accelerator, self.train_dl, state.micro_batches)
        self.detector.streak = 0
        self.event({"event": "rollback", "step": spike_step, "loss": loss, "to_checkpoint": str(path),
                    "resumed_step": state.step, "rollbacks": self.rollbacks.rollbacks, "lr_scale": state.lr_scale,
                    "skipped_micro_batches": skipped}, spike_step)
        session.accelerator.print(f"loss spike at step {spike_step}: rolled back to {path.name}, "
                                  f"lr x {state.lr_scale:.3g}")
        session.discard_window()  # the spike's steps and the reload are not training throughput

    def event(self, record: dict, step: int) -> None:
        import time

        from llmlab.core.io import append_jsonl

        if self.session.accelerator.is_main_process:
            append_jsonl(self.session.out / "events.jsonl", {"time": time.time(), **record})
        self.session.log({f"events/{record['event']}": str(record), "train/rollbacks": self.rollbacks.rollbacks},
                         step)

    def loss_scale(self):
        from llmlab.train.pretrain_setup import loss_scale

        return loss_scale(self.session.accelerator, self.optimizer)

    def final_samples(self) -> list[str]:
        """Greedy continuations of --sample_prompts by the final model, with repetition guards (no repeated
        trigram, repetition penalty 1.2) so a barely trained model does not just loop: the first thing a newcomer
        reads, and logged to TensorBoard's Text tab."""
        acc, cfg = self.session.accelerator, self.cfg
        if not (cfg.sample_prompts and cfg.sample_tokens and acc.is_main_process):
            return []
        import torch

        model = acc.unwrap_model(self.model).model.eval()
        texts = []
        for prompt in cfg.sample_prompts:
            ids = self.tokenizer(prompt, return_tensors="pt").input_ids.to(acc.device)
            with torch.no_grad(), acc.autocast():
                out = model.generate(ids, max_new_tokens=cfg.sample_tokens, do_sample=False, no_repeat_ngram_size=3,
                                     repetition_penalty=1.2, pad_token_id=self.tokenizer.eos_token_id)
            texts.append(self.tokenizer.decode(out[0], skip_special_tokens=True))
        print("\n".join(f"sample: {text!r}" for text in texts), flush=True)
        self.session.log({"samples/final": "\n\n".join(texts)}, self.session.state.step)
        return texts

    def save_final(self):
        from llmlab.train.pretrain_setup import save_final

        with self.session.paused():
            return save_final(self.session.accelerator, self.model, self.tokenizer, self.session.out)
