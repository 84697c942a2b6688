"""Every factor a design may vary: its level check, its default (the sweep-wide setting) and how a trial applies it.

Adding a factor is one `Factor` entry here plus the trial code that reads `hp.<name>` (llmlab.sweep.spec makes
the typed `Hparams` from this registry): designs, YAML grids, results.csv, the report's contrasts, the sensitivity
map and the interaction tests then pick it up by name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from llmlab.core.errors import UserError
from llmlab.train.config import CLIP_MODES, OPTIMIZERS, SCHEDULES, parse_clip

POSITION_ENCODINGS = ("sinusoidal", "learned", "rope")
LOSS_MASKS = ("full", "padding")  # every next-token position, or none predicting padding (per-document rows)
# WIDTHxDEPTH, or WIDTHxDEPTH@STEPS: one probe trained for its own number of steps (a scan across lengths)
SIZE_PATTERN = re.compile(r"^(\d+)x(\d+)(?:@(\d+))?$")

# doe20's five factors and their three levels (every factor a design may vary: llmlab.sweep.factors.REGISTRY)
FACTORS: dict[str, list[Any]] = {
    "scheduler": ["linear", "cosine", "polynomial"],
    "clip": [0.5, 1.0, 2.0],
    "warmup": [100, 500, 1000],
    "weight_decay": [0.0, 0.001, 0.01],
    "optimizer": ["adamw", "lion", "adafactor"],
}
CONTROL: dict[str, Any] = {
    "scheduler": "cosine",
    "clip": 1.0,
    "warmup": 500,
    "weight_decay": 0.01,
    "optimizer": "adamw",
}


class BadLevel(ValueError):
    """A level a factor cannot take; the message says what it expects."""


@dataclass(frozen=True)
class Factor:
    name: str
    check: Callable[[Any], Any]  # normalises a level, or raises BadLevel(expected)
    default: Callable[[Any], Any]  # SweepConfig -> the level of a trial that leaves the factor out
    applies: str  # how a trial applies it (documentation; the trial reads hp.<name>)


def one_of(*choices: str, aliases: dict[str, str] | None = None, registry=None) -> Callable[[Any], Any]:
    """A level among `choices`, or among a registry's names when it is checked (a later registration counts)."""

    def check(value):
        choices_now = tuple(registry) if registry is not None else choices
        value = (aliases or {}).get(str(value).lower(), str(value).lower()) if isinstance(value, str) else value
        if value not in choices_now:
            raise BadLevel(f"one of {', '.join(choices_now)}")
        return value

    return check


def number(low: float = 0.0, high: float = math.inf, open_low: bool = False, integer: bool = False):
    """A finite number in [low, high) (or (low, high) with open_low); never a bool, nan or inf."""
    span = f"{'(' if open_low else '['}{low:g}, {'inf' if high == math.inf else f'{high:g}'})"
    expected = f"a {'whole number' if integer else 'finite number'} in {span}"

    def check(value):
        if isinstance(value, str) and not integer:
            try:
                value = float(value)
            except ValueError:
                raise BadLevel(expected) from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
            raise BadLevel(expected)
        if not math.isfinite(value) or value < low or (open_low and value == low) or value >= high:
            raise BadLevel(expected)
        return int(value) if integer else float(value)

    return check


def clip_level(value):
    if isinstance(value, str) and value.strip().lower() == "adaptive":
        return "adaptive"
    try:
        return number()(value)
    except BadLevel:
        raise BadLevel("a finite number >= 0 or 'adaptive'") from None


def size_level(value):
    if not isinstance(value, str) or not SIZE_PATTERN.match(value):
        raise BadLevel("WIDTHxDEPTH or WIDTHxDEPTH@STEPS, e.g. 128x2 or 128x12@600")
    return value


def _control(name: str) -> Callable[[Any], Any]:
    return lambda cfg: CONTROL[name]


def _clip_default(cfg) -> Any:
    return parse_clip(cfg.clip) if cfg.clip is not None else CONTROL["clip"]


REGISTRY: dict[str, Factor] = {
    f.name: f
    for f in (
        Factor(
            "scheduler",
            one_of(aliases={"constant_with_warmup": "constant"}, registry=SCHEDULES),
            _control("scheduler"),
            "lr schedule after warmup (llmlab.train.optim)",
        ),
        Factor("clip", clip_level, _clip_default, "clip bound (0 = off, adaptive = 1.5 x recent mean norm)"),
        Factor(
            "warmup",
            number(integer=True),
            _control("warmup"),
            "warmup steps of the full protocol, scaled to the budget",
        ),
        Factor("weight_decay", number(), _control("weight_decay"), "weight decay on matrices"),
        Factor("optimizer", one_of(registry=OPTIMIZERS), _control("optimizer"), "optimizer (llmlab.train.optim)"),
        Factor(
            "lr", number(), lambda cfg: cfg.default_lr(), "peak learning rate (0 freezes the model: a flat-loss drill)"
        ),
        Factor(
            "batch_size",
            number(1, integer=True),
            lambda cfg: cfg.batch_size or cfg.budget_spec.batch_size,
            "sequences per optimizer step",
        ),
        Factor(
            "accumulation",
            number(1, integer=True),
            lambda cfg: 1,
            "micro batches per step at equal effective batch: micro batch = batch_size / accumulation",
        ),
        Factor(
            "position_encoding",
            one_of(*POSITION_ENCODINGS),
            lambda cfg: cfg.position_encoding,
            "the minimal model's positions",
        ),
        Factor("clip_mode", one_of(*CLIP_MODES), lambda cfg: "norm", "clip the global norm or every element"),
        Factor(
            "label_smoothing", number(0, 1), lambda cfg: cfg.label_smoothing, "label smoothing of the training loss"
        ),
        Factor(
            "loss_mask",
            one_of(*LOSS_MASKS),
            lambda cfg: "full",
            "full: packed blocks, loss on every next token; padding: one document per row, padded, padding masked",
        ),
        Factor(
            "token_mask_ratio",
            number(0, 1),
            lambda cfg: 0.0,
            "share of target positions left out of the training loss (every k-th, alternating even/odd rows)",
        ),
        Factor("size", size_level, lambda cfg: None, "WIDTHxDEPTH of the model family"),
    )
}
EXTRA_FACTORS = tuple(name for name in REGISTRY if name not in FACTORS)  # what a YAML grid may vary beyond doe20


def check_level(name: str, value: Any, where: str) -> Any:
    """A design's level of factor `name`, normalised, or a one-line error naming the place and the fix."""
    try:
        return REGISTRY[name].check(value)
    except BadLevel as bad:
        raise UserError(f"{where}: {name} = {value!r} is invalid ({bad}); fix the grid file") from None


def resolve(cfg, trial: dict) -> dict:
    """Every factor's level for one trial: the design's where it set one, else the sweep-wide default."""
    return {name: trial[name] if name in trial else factor.default(cfg) for name, factor in REGISTRY.items()}
