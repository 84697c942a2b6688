"""Experimental designs: doe20 (control + balanced Latin hypercube), lr_bs, and user YAML grids.

A design is a list of trials; a trial is a dict with `trial_id` plus hyperparameters. Factor levels are
stored as their real values (e.g. clip 0.5), so a row reads the same in the design table and results.csv.
"""
from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np

from llmlab.core.errors import UserError

FACTORS: dict[str, list[Any]] = {
    "scheduler": ["linear", "cosine", "polynomial"],
    "clip": [0.5, 1.0, 2.0],
    "warmup": [100, 500, 1000],
    "weight_decay": [0.0, 0.001, 0.01],
    "optimizer": ["adamw", "lion", "adafactor"],
}
CONTROL: dict[str, Any] = {"scheduler": "cosine", "clip": 1.0, "warmup": 500, "weight_decay": 0.01, "optimizer": "adamw"}
MIN_LEVEL_COUNT = 6

SCHEDULERS = ("linear", "cosine", "polynomial", "constant_with_warmup")
OPTIMIZERS = ("adamw", "lion", "adafactor")
DEFAULT_LRS = {"minimal": [1e-4, 3e-4, 1e-3, 3e-3], "gpt2": [5e-6, 1e-5, 2e-5, 3e-5]}
DEFAULT_BATCH_SIZES = [8, 16, 32, 64, 128]


def level_counts(points: list[list[int]], n_factors: int, n_levels: int = 3) -> np.ndarray:
    counts = np.zeros((n_factors, n_levels), dtype=int)
    for point in points:
        for factor, level in enumerate(point):
            counts[factor, level] += 1
    return counts


def balance_design(points: list[list[int]], fixed: int = 1, min_count: int = MIN_LEVEL_COUNT,
                   n_levels: int = 3) -> list[list[int]]:
    """Repair level indices so every level of every factor appears >= min_count times.

    The first `fixed` points (the control) are never changed. A deficient level takes over one point
    from the factor's most frequent level, choosing the point whose change creates no duplicate row,
    so the repair moves as few cells as possible and keeps the design's spread.
    """
    points = [list(p) for p in points]
    n_factors = len(points[0])
    if min_count * n_levels > len(points):
        raise ValueError(f"{len(points)} runs cannot hold {min_count} of each of {n_levels} levels")
    for factor in range(n_factors):
        while True:
            counts = level_counts(points, n_factors, n_levels)[factor]
            short = int(counts.argmin())
            if counts[short] >= min_count:
                break
            donor = int(counts.argmax())
            existing = {tuple(p) for p in points}
            candidates = [i for i in range(fixed, len(points)) if points[i][factor] == donor]
            unique = [i for i in candidates
                      if tuple(points[i][:factor] + [short] + points[i][factor + 1:]) not in existing]
            points[(unique or candidates)[0]][factor] = short
    return points


def latin_hypercube_levels(n_points: int, n_factors: int, seed: int, n_levels: int = 3) -> list[list[int]]:
    """A seeded pyDOE3 Latin hypercube, each [0, 1) coordinate mapped to one of n_levels equal bins."""
    from pyDOE3 import lhs

    unit = lhs(n_factors, samples=n_points, criterion="maximin", random_state=np.random.RandomState(seed))
    return np.minimum((unit * n_levels).astype(int), n_levels - 1).tolist()


def doe20_design(seed: int = 42) -> list[dict[str, Any]]:
    """The control plus 19 Latin-hypercube points, balanced (>= 6 per level) and duplicate-free."""
    names = list(FACTORS)
    control = [FACTORS[n].index(CONTROL[n]) for n in names]
    sampled = latin_hypercube_levels(19, len(names), seed)
    points = balance_design([control] + sampled)
    points = _remove_duplicates(points)
    trials = [{"trial_id": "control", **CONTROL}]
    for index, point in enumerate(points[1:], start=1):
        trials.append({"trial_id": f"t{index:02d}", **{n: FACTORS[n][level] for n, level in zip(names, point)}})
    return trials


def _remove_duplicates(points: list[list[int]]) -> list[list[int]]:
    """Move a repeated row to the nearest unused combination that keeps every level count >= the minimum."""
    n_factors = len(points[0])
    for i in range(1, len(points)):
        if tuple(points[i]) not in {tuple(p) for j, p in enumerate(points) if j != i}:
            continue
        for factor, level in itertools.product(range(n_factors), range(3)):
            trial = points[i][:factor] + [level] + points[i][factor + 1:]
            others = {tuple(p) for j, p in enumerate(points) if j != i}
            counts = level_counts(points[:i] + [trial] + points[i + 1:], n_factors)
            if tuple(trial) not in others and counts.min() >= MIN_LEVEL_COUNT:
                points[i] = trial
                break
    return points


def lr_bs_design(lrs: list[float], batch_sizes: list[int]) -> list[dict[str, Any]]:
    """Every learning rate x every (effective) batch size, other factors at the control levels."""
    return [{"trial_id": f"lr{lr:.0e}_bs{bs}".replace("e-0", "e-"), **CONTROL, "lr": lr, "batch_size": bs}
            for bs in batch_sizes for lr in lrs]


GRID_KEYS = set(FACTORS) | {"lr", "batch_size", "trial_id"}


def _check_value(key: str, value: Any, where: str) -> Any:
    def bad(expected: str):
        return UserError(f"{where}: {key} = {value!r} is invalid ({expected}); fix the grid file")

    if key == "scheduler":
        if value not in SCHEDULERS:
            raise bad(f"one of {', '.join(SCHEDULERS)}")
    elif key == "optimizer":
        if str(value).lower() not in OPTIMIZERS:
            raise bad(f"one of {', '.join(OPTIMIZERS)}")
        value = str(value).lower()
    elif key == "clip":
        if isinstance(value, str) and value.strip().lower() == "adaptive":
            return "adaptive"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise bad("a number >= 0 or 'adaptive'")
        value = float(value)
    elif key in ("warmup", "batch_size"):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "batch_size" else 0):
            raise bad("a whole number >= 0" if key == "warmup" else "a whole number >= 1")
    elif key in ("weight_decay", "lr"):
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise bad("a number >= 0") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise bad("a number >= 0")
        value = float(value)
    elif key == "trial_id":
        if not isinstance(value, (str, int)) or not str(value).replace("-", "").replace("_", "").isalnum():
            raise bad("letters, digits, - and _ only")
        value = str(value)
    return value


def _check_keys(keys, where: str) -> None:
    unknown = sorted(set(keys) - GRID_KEYS)
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}; "
                        f"allowed: {', '.join(sorted(GRID_KEYS))}")


def grid_from_yaml(path: str | Path) -> list[dict[str, Any]]:
    """A user grid: `trials: [{...}, ...]` (explicit) or `factorial: {factor: [levels]}` (full factorial).

    Factors left out take the control level; the first trial (or one named `control`) is the reference.
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise UserError(f"grid file {path} not found; pass --grid doe20, lr_bs or an existing YAML file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise UserError(f"grid file {path} is not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict) or len(set(data) & {"trials", "factorial"}) != 1 or len(data) != 1:
        raise UserError(f"grid file {path} must hold exactly one key: `trials:` (a list of settings) "
                        "or `factorial:` (factor: [levels])")
    if "trials" in data:
        entries = data["trials"]
        if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
            raise UserError(f"grid file {path}: `trials:` must be a non-empty list of mappings (factor: value)")
        rows = []
        for index, entry in enumerate(entries, start=1):
            where = f"grid file {path}, trial {index}"
            _check_keys(entry, where)
            rows.append({"trial_id": f"g{index:02d}", **CONTROL,
                         **{k: _check_value(k, v, where) for k, v in entry.items()}})
    else:
        levels = data["factorial"]
        if not isinstance(levels, dict) or not levels:
            raise UserError(f"grid file {path}: `factorial:` must map factor names to lists of levels")
        _check_keys(levels, f"grid file {path}")
        if "trial_id" in levels:
            raise UserError(f"grid file {path}: trial_id cannot be a factorial factor")
        for key, values in levels.items():
            if not isinstance(values, list) or not values:
                raise UserError(f"grid file {path}: factorial levels of {key} must be a non-empty list")
        names = list(levels)
        checked = [[_check_value(n, v, f"grid file {path}") for v in levels[n]] for n in names]
        rows = [{"trial_id": f"g{i:02d}", **CONTROL, **dict(zip(names, combo))}
                for i, combo in enumerate(itertools.product(*checked), start=1)]
    ids = Counter(r["trial_id"] for r in rows)
    repeated = [i for i, n in ids.items() if n > 1]
    if repeated:
        raise UserError(f"grid file {path}: trial_id {repeated[0]!r} is used more than once")
    return rows


def build_design(grid: str, lrs: list[float] | None = None, batch_sizes: list[int] | None = None,
                 model: str = "minimal", seed: int = 42) -> list[dict[str, Any]]:
    """Resolve `--grid`: a registered name (doe20, lr_bs) or a YAML file path."""
    if grid in GRIDS:
        return GRIDS[grid](lrs=lrs, batch_sizes=batch_sizes, model=model, seed=seed)
    if grid.endswith((".yaml", ".yml")) or Path(grid).exists():
        return grid_from_yaml(grid)
    raise UserError(f"--grid {grid!r} is neither a known grid ({', '.join(GRIDS)}) nor a .yaml file")


def _lr_bs(lrs=None, batch_sizes=None, model="minimal", **_) -> list[dict[str, Any]]:
    default = DEFAULT_LRS["minimal" if model == "minimal" else "gpt2"]
    return lr_bs_design(list(lrs or default), list(batch_sizes or DEFAULT_BATCH_SIZES))


GRIDS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "doe20": lambda seed=42, **_: doe20_design(seed),
    "lr_bs": _lr_bs,
}


def design_table(trials: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A Markdown table of the design (printed before any run starts, and put in report.md)."""
    columns = columns or ["trial_id"] + [c for c in list(FACTORS) + ["lr", "batch_size"]
                                         if any(c in t for t in trials)]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for trial in trials:
        lines.append("| " + " | ".join(str(trial.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)
