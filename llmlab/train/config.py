"""Config groups both trainers compose (litgpt-style: small, documented groups), flat on the command line and in YAML.

    RunGroup         the run folder, trackers, seed, threads, resume / overwrite
    OptimGroup       optimizer, schedule, lr, clipping, regularisation, length
    CheckpointGroup  checkpoint cadence and retention
    EvalGroup        evaluation cadence
    LoggingGroup     logging cadence

A trainer's config inherits the groups (PretrainConfig, LoraTrainConfig), so its flags and YAML keys stay flat,
and gives its own defaults for the groups' options it wants otherwise (`group_defaults`) without redeclaring them.
A component takes its group as an object and reads nothing else (litgpt's TrainArgs / EvalArgs):
`CheckpointGroup.of(cfg)` for the checkpointer, `LoggingGroup.of(cfg)` for the meter, `EvalGroup.of(cfg)` for an
evaluator. `resolved()` checks every value and returns the config a run uses (defaults that depend on other options
filled in); nothing mutates a config after it was built. This module imports no torch: a bad flag is answered
before the training stack loads (~2 s).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, fields
from typing import Any, Literal, Optional

from llmlab.core.config import check_report_to, opt
from llmlab.core.errors import UserError
from llmlab.train.components import (  # noqa: F401 (the registries configs choose from)
    DEFAULT_DECAY_FRACTION,
    DEFAULT_DECAY_SHAPE,
    OPTIMIZERS,
    SCHEDULES,
)

CLIP_MODES = ("norm", "value")  # rescale the global gradient norm, or clamp every element to [-clip, clip]


def parse_clip(value: str | float) -> float | str:
    """`--clip` takes a max grad norm (a number; 0 disables clipping) or "adaptive"."""
    if isinstance(value, str) and value.strip().lower() == "adaptive":
        return "adaptive"
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise UserError(f"--clip: expected a number or 'adaptive', got {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise UserError(f"--clip: must be a finite number >= 0 (0 disables clipping), got {value!r}")
    return number


def require(checks: list[tuple[bool, str]]) -> None:
    """The first failed check, as a one-line error."""
    for ok, message in checks:
        if not ok:
            raise UserError(message)


class Group:
    """A documented group of options. A trainer's config inherits it (flat flags); `of(cfg)` is the group's own
    object, holding that config's values, for the component that needs only them."""

    @classmethod
    def of(cls, cfg):
        return cls(**{field.name: getattr(cfg, field.name) for field in fields(cls)})


def group_defaults(**values: Any):
    """A trainer's own defaults for options of the groups it inherits, declared without redeclaring the options: each
    keeps its group's type, help line and place. A value may be `(default, help)` where the option means more for
    this trainer. Put it under `@dataclass`:

        @dataclass
        @group_defaults(save_every=100, keep_last=2)
        class LoraTrainConfig(RunGroup, CheckpointGroup, ...): ...
    """

    def decorate(cls):
        inherited, hints = {}, {}
        for base in reversed(cls.__mro__[1:]):
            if dataclasses.is_dataclass(base):
                inherited.update({field.name: field for field in fields(base)})
                hints.update(typing.get_type_hints(base))
        annotations = dict(cls.__dict__.get("__annotations__", {}))
        for name, value in values.items():
            if name not in inherited or name in annotations:
                raise TypeError(f"{cls.__name__}: {name!r} is not an inherited option, or is declared again here")
            field = inherited[name]
            default, help_line = value if isinstance(value, tuple) else (value, field.metadata["help"])
            setattr(cls, name, opt(default, help_line, **{k: v for k, v in field.metadata.items() if k != "help"}))
            annotations[name] = hints[name]  # the type itself: this module's names need not be imported there
        cls.__annotations__ = annotations
        return cls

    return decorate


@dataclass
class RunGroup(Group):
    output_dir: str = opt("runs/run", "run folder")
    overwrite_output_dir: bool = opt(
        False,
        "start afresh in an --output_dir that already holds a run of this kind "
        "(deletes that run's own files, nothing else)",
    )
    resume_from_checkpoint: Optional[str] = opt(None, "'latest' or a checkpoints/step_N folder to continue from")
    report_to: list[str] = opt(
        ["tensorboard"],
        "trackers: tensorboard, wandb, mlflow, aim, comet_ml, all or none (metrics.jsonl is always written)",
    )
    seed: int = opt(42, "seed for python/numpy/torch (model init, data order, dropout)")
    cpu_threads: int = opt(
        0,
        "CPU threads per process; 0 = PyTorch's default, or all cores when `accelerate "
        "launch` forced OMP_NUM_THREADS=1",
    )

    def check_run(self) -> None:
        require([(self.cpu_threads >= 0, f"--cpu_threads must be >= 0 (0 = automatic), got {self.cpu_threads}")])
        check_report_to(self.report_to)


@dataclass
class OptimGroup(Group):
    optimizer: str = opt(
        "adamw",
        "a registered optimizer (llmlab.train.components): adamw, lion (takes lr / 3 and "
        "weight decay x 3 of the values given) or adafactor (fixed lr)",
        choices=OPTIMIZERS,
    )
    weight_decay: float = opt(0.1, "weight decay (matrices only: never biases or LayerNorm weights)")
    decay_fraction: float = opt(
        DEFAULT_DECAY_FRACTION, "--lr_scheduler wsd: the share of the run (after warmup) spent decaying to the floor"
    )
    decay_shape: Literal["linear", "cosine", "sqrt"] = opt(
        DEFAULT_DECAY_SHAPE, "--lr_scheduler wsd: how it decays: linear, cosine, or sqrt (1 - sqrt, Hagele et al.)"
    )
    max_steps: Optional[int] = opt(None, "optimizer steps to train (upper bound)")
    clip: str = opt("1.0", "max grad norm, 0 = off, or 'adaptive' (1.5 x mean of the last 50 norms)")
    clip_mode: Literal["norm", "value"] = opt(
        "norm", "clip the global gradient norm, or clamp every gradient element to [-clip, clip]"
    )
    label_smoothing: float = opt(0.0, "label smoothing of the training loss (validation never smooths)")
    gradient_checkpointing: bool = opt(False, "recompute activations in backward: less memory, ~30%% slower")

    def check_optim(self) -> None:
        learning_rate = getattr(self, "learning_rate", 0.0) or 0.0
        require(
            [
                (
                    math.isfinite(learning_rate) and learning_rate >= 0,
                    f"--learning_rate must be a finite number >= 0, got {learning_rate}",
                ),
                (
                    math.isfinite(self.weight_decay) and self.weight_decay >= 0,
                    f"--weight_decay must be a finite number >= 0, got {self.weight_decay}",
                ),
                (self.max_steps is None or self.max_steps >= 1, f"--max_steps must be >= 1, got {self.max_steps}"),
                (0 <= self.label_smoothing < 1, f"--label_smoothing must be in [0, 1), got {self.label_smoothing}"),
                (0 < self.decay_fraction <= 1, f"--decay_fraction must be in (0, 1], got {self.decay_fraction}"),
            ]
        )
        parse_clip(self.clip)

    @property
    def schedule_options(self) -> dict:
        """The options a registered schedule may take (each takes only its own)."""
        return {"decay_fraction": self.decay_fraction, "decay_shape": self.decay_shape}


@dataclass
class CheckpointGroup(Group):
    save_every: int = opt(500, "save a resumable checkpoint every N optimizer steps")
    keep_last: int = opt(3, "keep only the newest N checkpoints")

    def check_checkpoints(self, allow_never: bool = False) -> None:
        low = 0 if allow_never else 1
        require(
            [
                (self.save_every >= low, f"--save_every must be >= {low}, got {self.save_every}"),
                (self.keep_last >= 1, f"--keep_last must be >= 1, got {self.keep_last}"),
            ]
        )


@dataclass
class EvalGroup(Group):
    eval_every: int = opt(100, "optimizer steps between evaluations")


@dataclass
class LoggingGroup(Group):
    log_every: int = opt(
        10, "write train metrics every N steps (a log step reads the steps since the last back from the device)"
    )

    def check_logging(self) -> None:
        require([(self.log_every >= 1, f"--log_every must be >= 1, got {self.log_every}")])
