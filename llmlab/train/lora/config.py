"""train_lora.py's options: the shared config groups (llmlab.train.config) and LoRA's own (data, adapter,
evaluation, early stopping). Light on purpose (no torch): a bad flag is answered before the training stack loads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from llmlab.core.config import opt
from llmlab.core.errors import UserError
from llmlab.core.io import llmlab_cache
from llmlab.data.instruct import DEFAULT_PROMPT, DEFAULT_PROMPT_NO_INPUT, check_templates
from llmlab.train.config import (
    OPTIMIZERS,
    SCHEDULES,
    CheckpointGroup,
    EvalGroup,
    LoggingGroup,
    OptimGroup,
    RunGroup,
    group_defaults,
    require,
)

DEFAULT_BASE_MODEL = "runs/pretrain/final"
# peft's shorthand (peft.utils.INCLUDE_LINEAR_LAYERS_SHORTHAND) for every Linear/Conv1D layer but the output head. The
# defaults below are the best of bench/lora_default.py's candidates (docs/findings, "LoRA defaults"): on the quick-start
# base, adapting every block moved test perplexity twice as far as c_attn alone, in the same wall time.
ALL_LINEAR = "all-linear"


def default_instruct_cache() -> str:
    return str(llmlab_cache("instruct"))


@dataclass
@group_defaults(
    output_dir=("runs/lora", "run folder: adapter/, eval.json, checkpoints/, config.yaml, tensorboard/"),
    seed=(0, "seed for LoRA init, dropout and shuffling"),
    max_steps=(500, "optimizer steps to train (upper bound, like --epochs: whichever ends first)"),
    weight_decay=(0.01, "weight decay (LoRA's A and B matrices)"),
    eval_every=(25, "optimizer steps between validation-loss evaluations"),
    save_every=(
        100,
        "save a resumable checkpoint (adapter, optimizer, scheduler, RNG, data position) every N optimizer steps; "
        "0 = never",
    ),
    keep_last=2,
)
class LoraTrainConfig(RunGroup, OptimGroup, CheckpointGroup, EvalGroup, LoggingGroup):
    # model and data
    base_model: str = opt(
        DEFAULT_BASE_MODEL,
        "model to adapt: a save_pretrained folder (train_pretrain.py writes "
        "runs/pretrain/final) or any Hugging Face causal-LM name",
    )
    tokenizer: Optional[str] = opt(None, "tokenizer name/path (default: the base model's own, else offline GPT-2 BPE)")
    dataset: str = opt(
        "builtin:pydoc",
        "instruction data: builtin:pydoc (offline, from the Python stdlib's "
        "docstrings), a .jsonl/.json file or a hub dataset with "
        "instruction/input/output",
    )
    dataset_config: Optional[str] = opt(None, "hub dataset configuration name")
    dataset_split: str = opt("train", "hub dataset split to read (it is then split 90/10 here)")
    max_examples: Optional[int] = opt(None, "use a seeded random subset of this many records (quick runs)")
    cache_dir: str = opt(default_instruct_cache(), "folder for the builtin:pydoc cache")
    val_fraction: float = opt(
        0.1,
        "fraction of the non-test records held out for validation (early stopping and "
        "choosing the best adapter use it)",
    )
    test_fraction: float = opt(
        0.1,
        "fraction of records held out as a test split that no training choice ever sees: "
        "its before/after numbers are the ones to quote",
    )
    data_seed: int = opt(1234, "seed of the train/validation split")
    max_length: int = opt(128, "max tokens of prompt + answer + eos (capped at the model's context)")
    prompt_template: str = opt(DEFAULT_PROMPT, "prompt for records with an input; uses {instruction} and {input}")
    prompt_template_no_input: str = opt(DEFAULT_PROMPT_NO_INPUT, "prompt for records with an empty input")
    # adapter
    lora_r: int = opt(16, "LoRA rank")
    lora_alpha: int = opt(32, "LoRA alpha (scale = alpha / r)")
    lora_dropout: float = opt(0.1, "dropout on the LoRA branch")
    target_modules: Optional[list[str]] = opt(
        [ALL_LINEAR],
        "modules to adapt: all-linear (every linear layer but "
        "the output head), names such as c_attn (GPT-2) or "
        "q_proj v_proj (Llama)",
    )
    # optimisation
    learning_rate: float = opt(3e-3, "peak learning rate")
    batch_size: int = opt(8, "examples per device per micro-batch")
    gradient_accumulation_steps: int = opt(2, "micro-batches per optimizer step")
    lr_scheduler: str = opt(
        "linear",
        "a registered schedule (llmlab.train.components) after the linear warmup (to 0; polynomial: power 2)",
        choices=SCHEDULES,
    )
    warmup_steps: int = opt(25, "linear warmup optimizer steps")
    epochs: int = opt(3, "passes over the training split (upper bound)")
    # evaluation and logging
    patience: int = opt(4, "stop after this many evaluations without a better validation loss")
    min_delta: float = opt(0.0, "an improvement must lower the validation loss by more than this")
    eval_batch_size: int = opt(16, "batch size for validation loss and generation")
    eval_examples: int = opt(32, "validation examples whose greedy answers are scored with ROUGE-L")
    max_new_tokens: int = opt(32, "max generated tokens per answer")
    sample_every: int = opt(100, "optimizer steps between sample generations logged to TensorBoard text")
    num_samples: int = opt(3, "validation prompts shown in each sample log")

    def resolved(self) -> "LoraTrainConfig":
        """Every value checked; LoRA has no derived defaults, so the config itself (nothing is changed)."""
        positive = (
            "max_length",
            "lora_r",
            "batch_size",
            "gradient_accumulation_steps",
            "epochs",
            "eval_every",
            "patience",
            "eval_batch_size",
            "max_new_tokens",
            "sample_every",
        )
        require(
            [(getattr(self, name) >= 1, f"--{name} must be >= 1, got {getattr(self, name)}") for name in positive]
            + [
                (
                    self.max_examples is None or self.max_examples >= 1,
                    f"--max_examples must be >= 1 (or omitted), got {self.max_examples}",
                )
            ]
            + [
                (getattr(self, name) >= 0, f"--{name} must be >= 0, got {getattr(self, name)}")
                for name in ("warmup_steps", "eval_examples", "num_samples")
            ]
            + [
                (0 < self.val_fraction < 1, f"--val_fraction must be between 0 and 1, got {self.val_fraction}"),
                (
                    0 <= self.test_fraction < 1 and self.val_fraction + self.test_fraction < 1,
                    f"--test_fraction must be in [0, 1) and leave records to train on (with --val_fraction), got "
                    f"{self.test_fraction}",
                ),
                (0 <= self.lora_dropout < 1, f"--lora_dropout must be in [0, 1), got {self.lora_dropout}"),
                (
                    not OPTIMIZERS[self.optimizer].hidden_matrices,
                    f"--optimizer {self.optimizer} steps a model's hidden matrices, and LoRA trains low-rank "
                    "factors beside them, which Muon's orthogonalised step is not made for; use --optimizer adamw",
                ),
            ]
        )
        self.check_run()
        self.check_optim()
        self.check_checkpoints(allow_never=True)
        self.check_logging()
        check_templates(self.prompt_template, self.prompt_template_no_input)
        return self


RUN_FILES = ("adapter", "checkpoints", "eval.json", "metrics.jsonl", "tensorboard", "config.yaml", "run_info.json")
# Options a resume may change: the run's length and lr (the schedule is recomputed from them), cadences and
# evaluation settings. Anything that changes the model, the data or its order is refused, naming the option.
RESUMABLE = (
    "max_steps",
    "epochs",
    "learning_rate",
    "warmup_steps",
    "eval_every",
    "patience",
    "min_delta",
    "eval_batch_size",
    "eval_examples",
    "max_new_tokens",
    "sample_every",
    "num_samples",
    "log_every",
    "save_every",
    "keep_last",
    "clip",
    "gradient_checkpointing",
)


def check_base_model(cfg) -> None:
    """A missing or mistaken --base_model in one line, before the training stack loads."""
    if cfg.base_model == DEFAULT_BASE_MODEL and not Path(cfg.base_model).is_dir():
        raise UserError(
            f"no pretrained model at {DEFAULT_BASE_MODEL}: run `accelerate launch train_pretrain.py` "
            "first, or pass --base_model (any Hugging Face model name or save_pretrained folder)"
        )
    if (Path(cfg.base_model).expanduser() / "adapter_config.json").is_file():
        raise UserError(
            f"--base_model {cfg.base_model} is a LoRA adapter folder, not a model; pass the model it was "
            "trained on as --base_model (or merge it first: merge_and_infer.py merge)"
        )
    # Hub names never start like a path; a missing local folder need not wait for the hub lookup.
    if cfg.base_model.startswith(("/", ".", "~")) and not Path(cfg.base_model).expanduser().exists():
        raise UserError(
            f"cannot load --base_model {cfg.base_model!r} (no such folder); pass a save_pretrained "
            "folder or a Hugging Face model name"
        )
