"""train_pretrain.py's options: the shared config groups (llmlab.train.config), the data pipeline's options
(llmlab.data.prepare.DataConfig) and pretraining's own (model, batch, precision, spike rollback, samples).

Light on purpose (no torch): a bad flag is answered before the training stack loads."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Literal, Optional

from llmlab.core.config import opt
from llmlab.data.prepare import DataConfig
from llmlab.models.gpt2 import (
    GPT2_PRESETS,
    context_length_of,  # transformers' AutoConfig: only for --init_from
)
from llmlab.train.config import (
    SCHEDULES,
    CheckpointGroup,
    EvalGroup,
    LoggingGroup,
    OptimGroup,
    RunGroup,
    group_defaults,
    require,
)
from llmlab.train.spikes import check_drill, parse_inject_spike

# gpt2-tiny's recipe: about four minutes on two CPU cores (bench/quickstart.py measures it against the old one).
# bf16 autocast and the chunked loss run ~1.25x the old fp32 tokens/s end to end, so 190 steps fit the wall time of
# the old 150; lr 2e-3 was the best of the peak lrs tried at this length (docs/findings/README.md).
TINY_MAX_STEPS = 190
TINY_LEARNING_RATE = 2e-3
TINY_BLOCK_SIZE = 128
# --compile's default on a GPU: torch.compile of GPT-2 takes about a minute there (nanoGPT); a run this long earns it
# back at a 10 % faster step of 0.1 s or more. bench/gpu_throughput.py measures the compile and the gain.
COMPILE_MIN_STEPS = 500

# Files a pretraining run writes into --output_dir: their presence means the folder holds a run.
RUN_FILES = ("checkpoints", "final", "metrics.jsonl", "events.jsonl", "tensorboard", "config.yaml", "run_info.json")
# Options a resume may change: the schedule's length and lr are recomputed from them at the resumed step, the
# rest are cadences and safety nets. Anything else (model, data, batch, precision, seed, ...) is refused.
RESUMABLE = (
    "eval_tasks",
    "eval_tasks_every",
    "eval_tasks_limit",
    "max_steps",
    "learning_rate",
    "min_lr",
    "warmup_steps",
    "decay_fraction",  # a wsd trunk resumed into a cooldown of another length or shape
    "decay_shape",
    "eval_every",
    "eval_batches",
    "log_every",
    "save_every",
    "keep_last",
    "spike_factor",
    "spike_window",
    "spike_patience",
    "spike_arm_steps",
    "rollback_lr_factor",
    "max_rollbacks",
    "rollback_skip_data",
    "inject_spike",
    "gradient_checkpointing",
    "clip",
    "loss_chunk_tokens",
    "compile",
    "attn_implementation",
    "tf32",
    "pin_memory",
    "sample_prompts",
    "sample_tokens",
)


@dataclass
@group_defaults(
    output_dir=("runs/pretrain", "run folder: checkpoints/, final/, tensorboard/, metrics.jsonl"),
    max_steps=(
        None,
        f"optimizer steps to train; default: one pass over the training split, for gpt2-tiny {TINY_MAX_STEPS}",
    ),
)
class PretrainConfig(DataConfig, RunGroup, OptimGroup, CheckpointGroup, EvalGroup, LoggingGroup):
    # model
    model: Literal["gpt2-tiny", "gpt2", "gpt2-medium"] = opt("gpt2-tiny", "GPT-2 preset to train from scratch")
    init_from: Optional[str] = opt(None, "start from this HF model name/path instead of a fresh preset")
    n_layer: Optional[int] = opt(None, "override the preset's number of layers (small test/sweep models)")
    n_embd: Optional[int] = opt(None, "override the preset's hidden size")
    n_head: Optional[int] = opt(None, "override the preset's attention heads")
    dropout: float = opt(0.0, "dropout of a fresh preset (0 is usual for pretraining; ignored with --init_from)")
    parametrization: Literal["standard", "mup"] = opt(
        "standard",
        "standard (GPT-2's own), or mup: muP's width-scaled init, readout and per-layer Adam lr "
        "(llmlab/models/mup.py), so the lr sweep.py measures on narrow GPT-2 probes holds at this width",
    )
    mup_base_width: int = opt(
        128,
        "muP: the n_embd at which muP equals the standard parametrization (128: the lab's GPT-2 probes'; "
        "sweep.py recommend writes its scan's)",
    )
    block_size: Optional[int] = opt(
        None, "tokens per training sequence; default: the model's context length (up to 1024); gpt2-tiny: 128"
    )
    # optimisation (OptimGroup, with pretraining's defaults)
    learning_rate: Optional[float] = opt(
        None, f"peak learning rate; default 6e-4, for gpt2-tiny {TINY_LEARNING_RATE:g}"
    )
    lr_scheduler: str = opt(
        "cosine",
        "a registered schedule (llmlab.train.components) after the linear warmup, "
        "decaying to --min_lr (polynomial: power 2)",
        choices=SCHEDULES,
    )
    min_lr: float = opt(1e-5, "floor of the decay")
    adam_beta1: float = opt(0.9, "beta1 of AdamW and Lion")
    adam_beta2: float = opt(0.98, "beta2 of AdamW and Lion")
    adam_eps: float = opt(1e-6, "AdamW epsilon")
    warmup_steps: Optional[int] = opt(None, "linear warmup steps; default 2000, for gpt2-tiny 10%% of max_steps")
    batch_size: int = opt(8, "micro-batch: sequences per device per forward pass")
    effective_batch_size: Optional[int] = opt(
        None, "sequences per optimizer step (reached by gradient accumulation); default 512, for gpt2-tiny = batch_size"
    )
    # speed and precision
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = opt(
        "auto",
        "auto = under `accelerate launch` the launch's own precision (its config or flag), else bf16 autocast "
        "where the hardware has bf16 units (AVX512-BF16/AMX CPUs, Ampere+ GPUs), fp16 on older GPUs, else no",
    )
    compile: Optional[bool] = opt(
        None,
        "torch.compile the transformer body; default: on a GPU for runs of at least "
        f"{COMPILE_MIN_STEPS} steps, else off (on a CPU a one-off 30-90 s that a short run does not earn back)",
    )
    attn_implementation: Literal["sdpa", "eager"] = opt(
        "sdpa", "attention kernel: sdpa = torch's scaled_dot_product_attention (flash attention on a GPU), eager"
    )
    tf32: bool = opt(True, "TF32 tensor cores for the matmuls left in float32 (Ampere+ GPUs; no effect on a CPU)")
    pin_memory: bool = opt(True, "page-locked batches, copied to the GPU without blocking (no effect on a CPU)")
    loss_chunk_tokens: int = opt(
        1024,
        "compute the output layer + loss in chunks of this many tokens, so the "
        "[tokens x vocab] logits never exist whole (0 = the model's full logits)",
    )
    # evaluation (EvalGroup)
    eval_batches: int = opt(20, "validation micro-batches per evaluation (the same tokens at any world size)")
    eval_tasks: list[str] = opt(
        [],
        "lm-evaluation-harness tasks the final model is scored on (acc, acc_norm to TensorBoard and metrics.jsonl): "
        "task names such as hellaswag (data from the hub), task YAML files, or builtin:pydoc-mc (offline)",
    )
    eval_tasks_every: int = opt(0, "also score --eval_tasks every N optimizer steps (0 = the final model only)")
    eval_tasks_limit: Optional[int] = opt(None, "score only the first N items of each task (unset = all)")
    # loss-spike rollback
    spike_factor: float = opt(2.0, "a step spikes when its loss exceeds this x the mean of the last window")
    spike_window: int = opt(100, "steps in the reference mean of the spike detector")
    spike_patience: int = opt(10, "consecutive spiking steps that trigger a rollback")
    spike_arm_steps: int = opt(20, "normal steps after which the detector arms (before its window is full)")
    rollback_lr_factor: float = opt(0.8, "multiply the lr by this at each rollback")
    max_rollbacks: int = opt(5, "give up with an error after this many rollbacks")
    rollback_skip_data: bool = opt(
        True, "after a rollback, skip the batches seen since the checkpoint (the data window that caused the spike)"
    )
    inject_spike: Optional[str] = opt(
        None,
        "drill: STEP[:FACTOR] multiplies the loss of `spike_patience` "
        "steps from STEP by FACTOR (default 10) to trigger a rollback",
    )
    prepare_only: bool = opt(False, "only prepare (clean, tokenize, pack, cache) the dataset, print a summary")
    sample_prompts: list[str] = opt(
        ["The history of", "In mathematics,"],
        "prompts the final model continues (greedy) at the end, so you can read what it learned; empty = none",
    )
    sample_tokens: int = opt(24, "new tokens per final sample")

    @property
    def is_tiny(self) -> bool:
        return self.init_from is None and self.model == "gpt2-tiny"

    def data_config(self) -> DataConfig:
        """The data part alone (what prepare_dataset hashes)."""
        return DataConfig(**{f.name: getattr(self, f.name) for f in fields(DataConfig)})

    def resolved(self) -> "PretrainConfig":
        """Every value checked, the defaults that depend on the preset filled in; a new config, this one unchanged."""
        context = model_context_length(self)
        cfg = replace(self, block_size=self.block_size or (TINY_BLOCK_SIZE if self.is_tiny else min(context, 1024)))
        DataConfig.validate(cfg)
        require(
            [
                (
                    cfg.block_size <= context,
                    f"--block_size {cfg.block_size} exceeds the model's context length {context}; lower --block_size",
                )
            ]
        )
        if cfg.prepare_only:
            return cfg
        require([(cfg.batch_size >= 1, f"--batch_size must be >= 1, got {cfg.batch_size}")])
        max_steps = cfg.max_steps or (TINY_MAX_STEPS if cfg.is_tiny else None)
        cfg = replace(
            cfg,
            effective_batch_size=cfg.effective_batch_size or (cfg.batch_size if cfg.is_tiny else 512),
            learning_rate=cfg.learning_rate
            if cfg.learning_rate is not None
            else (TINY_LEARNING_RATE if cfg.is_tiny else 6e-4),
            max_steps=max_steps,
            warmup_steps=cfg.warmup_steps
            if cfg.warmup_steps is not None
            else (max(1, max_steps // 10) if cfg.is_tiny else 2000),
        )
        cfg.check_run()
        cfg.check_optim()
        cfg.check_checkpoints()
        cfg.check_logging()
        cfg.check_pretraining()
        return cfg

    def check_pretraining(self) -> None:
        require(
            [
                (self.learning_rate > 0, f"--learning_rate must be > 0, got {self.learning_rate}"),
                (0 <= self.min_lr <= self.learning_rate, f"--min_lr must be in [0, learning_rate], got {self.min_lr}"),
                (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1, "--adam_beta1/--adam_beta2 must be in [0, 1)"),
                (self.adam_eps > 0, "--adam_eps must be > 0"),
                (
                    self.effective_batch_size >= self.batch_size and self.effective_batch_size % self.batch_size == 0,
                    f"--effective_batch_size ({self.effective_batch_size}) must be a multiple of --batch_size "
                    f"({self.batch_size})",
                ),
                (self.warmup_steps >= 0, "--warmup_steps must be >= 0"),
                (0 <= self.dropout < 1, f"--dropout must be in [0, 1), got {self.dropout}"),
                (self.mup_base_width >= 1, f"--mup_base_width must be >= 1, got {self.mup_base_width}"),
                (
                    self.parametrization == "standard" or self.init_from is None,
                    "--parametrization mup builds a fresh model, and --init_from loads a trained one (saved as a "
                    "plain GPT-2); drop one of them",
                ),
                (self.eval_every >= 0 and self.eval_batches >= 1, "--eval_every must be >= 0 and --eval_batches >= 1"),
                (
                    self.eval_tasks_every >= 0 and (self.eval_tasks_limit is None or self.eval_tasks_limit >= 1),
                    "--eval_tasks_every must be >= 0 and --eval_tasks_limit >= 1",
                ),
                (self.spike_factor > 1, f"--spike_factor must be > 1, got {self.spike_factor}"),
                (
                    self.spike_window >= 1 and self.spike_patience >= 1 and self.spike_arm_steps >= 1,
                    "--spike_window, --spike_patience and --spike_arm_steps must be >= 1",
                ),
                (
                    0 < self.rollback_lr_factor <= 1,
                    f"--rollback_lr_factor must be in (0, 1], got {self.rollback_lr_factor}",
                ),
                (self.max_rollbacks >= 0, f"--max_rollbacks must be >= 0, got {self.max_rollbacks}"),
                (self.loss_chunk_tokens >= 0, f"--loss_chunk_tokens must be >= 0, got {self.loss_chunk_tokens}"),
                (self.sample_tokens >= 0, f"--sample_tokens must be >= 0, got {self.sample_tokens}"),
            ]
        )
        check_drill(
            parse_inject_spike(self.inject_spike), self.save_every, min(self.spike_arm_steps, self.spike_window)
        )

    def for_data(self, train_blocks: int) -> "PretrainConfig":
        """The config of the run once the data is known: --max_steps defaults to one pass over the training split."""
        cfg = (
            self
            if self.max_steps is not None
            else replace(self, max_steps=max(1, train_blocks // self.effective_batch_size))
        )
        require(
            [
                (
                    cfg.warmup_steps < cfg.max_steps,
                    f"--warmup_steps ({cfg.warmup_steps}) must be below --max_steps ({cfg.max_steps})",
                )
            ]
        )
        return cfg


def model_context_length(cfg: PretrainConfig) -> int:
    if cfg.init_from is None:
        return GPT2_PRESETS[cfg.model]["n_positions"]
    return context_length_of(cfg.init_from)
