"""Experimental designs: doe20 (control + balanced Latin hypercube), lr_bs, and user YAML grids.

A design is a list of trials; a trial is a dict with `trial_id` plus hyperparameters. Factor levels are
stored as their real values (e.g. clip 0.5), so a row reads the same in the design table and results.csv.
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import yaml

from llmlab.core.errors import UserError
from llmlab.sweep.factors import CONTROL, EXTRA_FACTORS, FACTORS, REGISTRY, SIZE_PATTERN, BadLevel, check_level, number

MIN_LEVEL_COUNT = 6

DEFAULT_LRS = {"minimal": [1e-4, 3e-4, 1e-3, 3e-3], "gpt2": [5e-6, 1e-5, 2e-5, 3e-5]}
DEFAULT_BATCH_SIZES = [8, 16, 32, 64, 128]
# A multi-size scan (--sizes) at the cpu budget: 5 lrs a factor 2 apart around the probe's optimum (~1.5e-3 at
# batch 4) and 2 batch sizes keep three sizes to about an hour on 2 cores.
SIZED_LRS = {"minimal": [5e-4, 1e-3, 2e-3, 4e-3, 8e-3], "gpt2": [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3]}
SIZED_BATCH_SIZES = [4, 8]


def level_counts(points: list[list[int]], n_factors: int, n_levels: int = 3) -> np.ndarray:
    counts = np.zeros((n_factors, n_levels), dtype=int)
    for point in points:
        for factor, level in enumerate(point):
            counts[factor, level] += 1
    return counts


def balance_design(
    points: list[list[int]], fixed: int = 1, min_count: int = MIN_LEVEL_COUNT, n_levels: int = 3
) -> list[list[int]]:
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
            unique = [
                i for i in candidates if tuple(points[i][:factor] + [short] + points[i][factor + 1 :]) not in existing
            ]
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
            trial = points[i][:factor] + [level] + points[i][factor + 1 :]
            others = {tuple(p) for j, p in enumerate(points) if j != i}
            counts = level_counts(points[:i] + [trial] + points[i + 1 :], n_factors)
            if tuple(trial) not in others and counts.min() >= MIN_LEVEL_COUNT:
                points[i] = trial
                break
    return points


def lr_bs_design(lrs: list[float], batch_sizes: list[int], sizes: list[str] | None = None) -> list[dict[str, Any]]:
    """Every learning rate x every (effective) batch size (x every model size), other factors at the control levels."""
    grid = [
        {"trial_id": f"lr{lr:.0e}_bs{bs}".replace("e-0", "e-"), **CONTROL, "lr": lr, "batch_size": bs}
        for bs in batch_sizes
        for lr in lrs
    ]
    if not sizes:
        return grid
    return [{**trial, "trial_id": f"{size}_{trial['trial_id']}", "size": size} for size in sizes for trial in grid]


def size_steps(size) -> Optional[int]:
    """The steps a `WIDTHxDEPTH@STEPS` label trains (a scan across training lengths), else None."""
    match = SIZE_PATTERN.match(str(size))
    return int(match.group(3)) if match and match.group(3) else None


def parse_size(size: str, model: str, head_dim: int = 32) -> tuple[int, int]:
    """`WIDTHxDEPTH` (e.g. 192x4), or `WIDTHxDEPTH@STEPS`, -> (width, layers), checked against the family's head
    size (the minimal model's is --head_dim)."""
    match = SIZE_PATTERN.match(str(size))
    if not match:
        family = "minimal Transformer" if model == "minimal" else "GPT-2"
        raise UserError(
            f"--sizes {size!r} is not WIDTHxDEPTH (e.g. 128x2) or WIDTHxDEPTH@STEPS (e.g. 128x12@600): every size "
            f"of one scan is a width and a depth of the {family} family of --model {model}, trained for --steps or "
            "its own STEPS"
        )
    width, depth = int(match.group(1)), int(match.group(2))
    if match.group(3) is not None and int(match.group(3)) < 1:
        raise UserError(f"--sizes {size}: a probe trains at least one step")
    head = head_dim if model == "minimal" else 64
    if width < head or width % head or depth < 1:
        hint = (
            ""
            if model == "minimal"
            else " (--grid lr_bs probes GPT-2 by default: --model minimal for the minimal Transformer)"
        )
        raise UserError(
            f"--sizes {size}: the width must be a multiple of the {head}-wide attention heads of "
            f"--model {model} and the depth >= 1{hint}"
        )
    return width, depth


GRID_KEYS = set(REGISTRY) | {"trial_id", "seed"}
GRID_FILE_KEYS = {"trials", "factorial", "replicates", "replicate_all"}


def _check_value(key: str, value: Any, where: str) -> Any:
    """A grid's value for `key`: a factor level (llmlab.sweep.factors), a seed or a trial id."""
    if key in REGISTRY:
        return check_level(key, value, where)
    try:
        if key == "seed":
            return number(integer=True)(value)
        if (
            not isinstance(value, (str, int))
            or isinstance(value, bool)
            or not str(value).replace("-", "").replace("_", "").isalnum()
        ):
            raise BadLevel("letters, digits, - and _ only")
        return str(value)
    except BadLevel as bad:
        raise UserError(f"{where}: {key} = {value!r} is invalid ({bad}); fix the grid file") from None


def _check_keys(keys, where: str) -> None:
    unknown = sorted(set(keys) - GRID_KEYS)
    if unknown:
        raise UserError(
            f"{where}: unknown key(s) {', '.join(map(str, unknown))}; allowed: {', '.join(sorted(GRID_KEYS))}"
        )


def grid_from_yaml(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A user grid: `trials: [{...}, ...]` (explicit) or `factorial: {factor: [levels]}` (full factorial),
    optionally with `replicates: K` and `replicate_all: true`. Returns (trials, replication settings).

    Factors left out take the control level; the first trial (or one named `control`) is the reference.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"grid file {path} not found; pass --grid doe20, lr_bs or an existing YAML file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise UserError(f"grid file {path} is not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict) or len(set(data) & {"trials", "factorial"}) != 1 or set(data) - GRID_FILE_KEYS:
        raise UserError(
            f"grid file {path} must hold exactly one of `trials:` (a list of settings) or `factorial:` "
            "(factor: [levels]), plus optionally `replicates:` and `replicate_all:`"
        )
    settings = _replication_settings(data, path)
    if "trials" in data:
        entries = data["trials"]
        if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
            raise UserError(f"grid file {path}: `trials:` must be a non-empty list of mappings (factor: value)")
        rows = []
        for index, entry in enumerate(entries, start=1):
            where = f"grid file {path}, trial {index}"
            _check_keys(entry, where)
            rows.append(
                {"trial_id": f"g{index:02d}", **CONTROL, **{k: _check_value(k, v, where) for k, v in entry.items()}}
            )
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
        rows = [
            {"trial_id": f"g{i:02d}", **CONTROL, **dict(zip(names, combo))}
            for i, combo in enumerate(itertools.product(*checked), start=1)
        ]
    for row in rows:
        if row.get("clip_mode") == "value" and not (isinstance(row["clip"], float) and row["clip"] > 0):
            raise UserError(
                f"grid file {path}, trial {row['trial_id']}: clip_mode value needs a number clip > 0 "
                f"(got {row['clip']!r}); fix the grid file"
            )
    ids = Counter(r["trial_id"] for r in rows)
    repeated = [i for i, n in ids.items() if n > 1]
    if repeated:
        raise UserError(f"grid file {path}: trial_id {repeated[0]!r} is used more than once")
    return rows, settings


def _replication_settings(data: dict, path: Path) -> dict[str, Any]:
    settings = {}
    if "replicates" in data:
        value = data["replicates"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"grid file {path}: replicates = {value!r} is invalid (a whole number >= 1)")
        settings["replicates"] = value
    if "replicate_all" in data:
        if not isinstance(data["replicate_all"], bool):
            raise UserError(f"grid file {path}: replicate_all must be true or false")
        settings["replicate_all"] = data["replicate_all"]
    return settings


def replicate(design: list[dict[str, Any]], replicates: int, replicate_all: bool, seed: int) -> list[dict[str, Any]]:
    """Add seed replicates: K runs of the reference trial (or of every trial), each with its own seed for model
    init and data order. Replicate r of a trial runs with the trial's seed + r and is named `<id>-r<r>`; the
    data split never changes (it has its own seed). Trials keep any `seed` the grid gave them."""
    reference = reference_id(design)
    out = []
    for trial in design:
        base = {**trial, "seed": trial.get("seed", seed), "replicate": 0, "point": trial["trial_id"]}
        out.append(base)
        if replicate_all or trial["trial_id"] == reference:
            out += [
                {**base, "trial_id": f"{trial['trial_id']}-r{r}", "seed": base["seed"] + r, "replicate": r}
                for r in range(1, replicates)
            ]
    return out


def reference_id(design: list[dict]) -> str:
    """The trial others are compared with: the one named `control`, else the first."""
    ids = [t["trial_id"] for t in design]
    return "control" if "control" in ids else ids[0]


def base_design(
    grid: str,
    lrs: list[float] | None = None,
    batch_sizes: list[int] | None = None,
    model: str = "minimal",
    seed: int = 42,
    sizes: list[str] | None = None,
    head_dim: int = 32,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Resolve `--grid` (a registered name or a YAML file) to its trials before replication, plus the
    replication settings a YAML file gave."""
    if grid in GRIDS:
        return GRIDS[grid](lrs=lrs, batch_sizes=batch_sizes, model=model, seed=seed, sizes=sizes, head_dim=head_dim), {}
    if grid.endswith((".yaml", ".yml")) or Path(grid).exists():
        return grid_from_yaml(grid)
    raise UserError(f"--grid {grid!r} is neither a known grid ({', '.join(GRIDS)}) nor a .yaml file")


# the control six times: 5 df put the seed SD's 95 % interval within [0.6, 2.5] x the estimate (3 runs: [0.5, 6.3] x)
DEFAULT_REPLICATES = {"doe20": 6}


def build_design(cfg) -> list[dict[str, Any]]:
    """The full design of a sweep config: its grid, then seed replicates (flags win over the grid file)."""
    design, settings = base_design(
        cfg.grid,
        lrs=cfg.lrs,
        batch_sizes=cfg.batch_sizes,
        model=cfg.model,
        seed=cfg.seed,
        sizes=cfg.sizes,
        head_dim=cfg.head_dim,
    )
    replicates = cfg.replicates or settings.get("replicates") or DEFAULT_REPLICATES.get(cfg.grid, 1)
    replicate_all = cfg.replicate_all or settings.get("replicate_all", False) or cfg.grid == "lr_bs"
    replicated = replicate(design, replicates, replicate_all, cfg.seed)
    ids = Counter(t["trial_id"] for t in replicated)
    clash = next((i for i, n in ids.items() if n > 1), None)
    if clash is not None:  # a replicate's name `<id>-r<k>` taken by a grid trial would overwrite one of them
        raise UserError(
            f"trial_id {clash!r} names two runs once replicates are added (replicates are named "
            "<trial_id>-r<k>); rename that grid trial"
        )
    return in_blocks(replicated, cfg.seed)


def in_blocks(trials: list[dict[str, Any]], seed: int, group: int = 0, label: str = "") -> list[dict[str, Any]]:
    """Name each trial's block (one seed replicate of the whole grid) and its place in the run order: blocks one after
    another, shuffled within from `seed`, so a stop or a change of machine falls between blocks and never leaves one
    part of the grid (the high lrs, say) to a later machine. The list itself keeps its order."""
    replicates = sorted({t.get("replicate", 0) for t in trials})
    for r in replicates:
        block = [t for t in trials if t.get("replicate", 0) == r]
        for place, k in enumerate(np.random.default_rng([seed, group, r]).permutation(len(block))):
            block[k].update(block=f"{label}r{r}", order=(group, r, place))
    return trials


def _lr_bs(lrs=None, batch_sizes=None, model="minimal", sizes=None, head_dim=32, **_) -> list[dict[str, Any]]:
    family = "minimal" if model == "minimal" else "gpt2"
    if sizes:
        for size in sizes:
            parse_size(size, model, head_dim)
        return lr_bs_design(list(lrs or SIZED_LRS[family]), list(batch_sizes or SIZED_BATCH_SIZES), list(sizes))
    return lr_bs_design(list(lrs or DEFAULT_LRS[family]), list(batch_sizes or DEFAULT_BATCH_SIZES))


GRIDS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "doe20": lambda seed=42, **_: doe20_design(seed),
    "lr_bs": _lr_bs,
}


def design_table(trials: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A Markdown table of the design (printed before any run starts, and put in report.md)."""
    columns = columns or ["trial_id"] + [
        c for c in list(FACTORS) + list(EXTRA_FACTORS) + ["seed"] if any(c in t for t in trials)
    ]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for trial in trials:
        lines.append("| " + " | ".join(str(trial.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def run_order(design: list[dict]) -> list[dict]:
    """The design in the order its trials run (design_for's blocks; a design without blocks keeps its order)."""
    return sorted(design, key=lambda t: tuple(t.get("order", ())))
