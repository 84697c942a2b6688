"""The adaptive multi-size lr scan (`--grid lr_bs --sizes ...`).

Sizes run in order of N. Each size's lr grid (--lr_points lrs, a factor --lr_step apart) is centred on the running
forecast: the law fitted on the sizes already measured (two or more), the one measured optimum, or --lr_center for
the first size. After a size's trials finish, a grid whose seed-mean minimum has fewer than two scanned lrs on
either side is extended past that edge (a side whose larger lrs diverged needs no extension: divergence bounds it),
up to --max_lr_extensions times, so an optimum on the grid edge is never taken for a measurement. Every grid is
written to scan_plan.json before it runs: a rerun resumes with the same grids, and the held-out size's forecast is
on disk before its first trial.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from llmlab.core.errors import UserError
from llmlab.core.io import atomic_write_json
from llmlab.scaling.fits import ScalingOptions, feasible_region
from llmlab.scaling.law import fit_law, predict
from llmlab.scaling.optimum import finite
from llmlab.scaling.transfer import seed_noise, size_points
from llmlab.sweep.design import CONTROL, parse_size, replicate
from llmlab.sweep.factors import REGISTRY
from llmlab.sweep.report import flat_row
from llmlab.sweep.spec import Hparams, TrialSpec
from llmlab.sweep.trial import build_trial_model, non_embedding_parameters

PLAN_FILE = "scan_plan.json"
DEFAULT_CENTER = {"minimal": 3e-3, "gpt2": 1e-3}
DEFAULT_SIZES = {"minimal": ["32x2", "64x2", "96x2", "128x2", "160x2", "320x2"],
                 "gpt2": ["64x2", "128x2", "192x2", "256x2", "320x2", "640x2"]}


def round_lr(lr: float) -> float:
    return float(f"{lr:.3g}")


def lr_label(lr: float) -> str:
    mantissa, exponent = f"{lr:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def cell_id(size: str, lr: float, batch: int) -> str:
    return f"{size}_lr{lr_label(lr)}_bs{batch}"


def centred_grid(centre: float, points: int, step: float) -> list[float]:
    return [round_lr(centre * step ** (k - (points - 1) / 2)) for k in range(points)]


def size_parameters(size: str, model: str) -> int:
    """Non-embedding N of one scanned size, built on the meta device (no memory, no time)."""
    width, depth = parse_size(size, model)
    hp = Hparams(**{**{name: None for name in REGISTRY}, "position_encoding": "rope"})
    spec = TrialSpec(trial_id=size, trial_dir="", data_dir="", hparams=hp, seed=0, steps=1, model=model,
                     model_width=width, model_depth=depth)
    with torch.device("meta"):
        return non_embedding_parameters(build_trial_model(spec, hp))


def scan_sizes(cfg) -> list[str]:
    family = "minimal" if cfg.model == "minimal" else "gpt2"
    sizes = DEFAULT_SIZES[family] if cfg.sizes == ["default"] else list(cfg.sizes)
    return sorted(sizes, key=lambda s: size_parameters(s, cfg.model))


def _feasible(rows: list[dict]) -> list[dict]:
    """Trials that finished with a finite loss below the uniform guess. No relative "unstable" rule here: a run whose
    early loss moved a lot still measured its final loss, and dropping it would bias the vertex."""
    return feasible_region(rows, ScalingOptions(unstable_std=math.inf))[0]


def _flat(results: list[dict]) -> list[dict]:
    return [flat_row(r) for r in results]


def running_centre(cfg, size: str, batch: int, rows: list[dict], n_of: dict[str, int]) -> dict:
    """Where this size's grid is centred: the law on the sizes measured so far (the report's own estimator), one
    size's optimum, or the configured centre; with the forecast's interval when there is one."""
    feasible = [r for r in _feasible(rows) if float(r["batch_size"]) == batch]
    measured = [p for p in size_points(feasible, seed_noise(feasible)) if p["status"] == "measured"]
    if len(measured) >= 3:
        law = fit_law(measured, with_batch=False)
        if law["status"] == "ok":
            forecast = predict(law, n_of[size], batch)
            return {"centre": forecast["lr"], "source": f"law fitted on {', '.join(law['sizes'])}",
                    "prediction_interval": forecast["pi"], "alpha": law["alpha"]}
    if len(measured) == 2:  # a line through two optima: a forecast without an interval
        (a, b) = sorted(measured, key=lambda m: m["n_params"])
        slope = (b["ln_lr_opt"] - a["ln_lr_opt"]) / math.log(b["n_params"] / a["n_params"])
        return {"centre": math.exp(b["ln_lr_opt"] + slope * math.log(n_of[size] / b["n_params"])),
                "source": f"line through the optima of {a['size']} and {b['size']}"}
    if measured:
        return {"centre": measured[0]["lr_opt"], "source": f"optimum measured at {measured[0]['size']}"}
    lr = cfg.lr_center or DEFAULT_CENTER["minimal" if cfg.model == "minimal" else "gpt2"]
    return {"centre": lr, "source": "--lr_center" if cfg.lr_center else "default centre"}


def extension(trials: list[dict], feasible_ids: set, step: float) -> list[float]:
    """lrs to add so the seed-mean minimum has two scanned lrs on each side (none past a diverged side)."""
    lrs = sorted({float(t["lr"]) for t in trials})
    means = {}
    for lr in lrs:
        losses = [float(t["final_loss"]) for t in trials if float(t["lr"]) == lr and t["trial_id"] in feasible_ids]
        means[lr] = float(np.mean(losses)) if losses else math.inf
    if not any(math.isfinite(m) for m in means.values()):
        return []  # nothing trained: no direction to extend in
    best = min(lrs, key=lambda lr: means[lr])
    below, above = [lr for lr in lrs if lr < best], [lr for lr in lrs if lr > best]
    new = [round_lr(lrs[0] / step ** k) for k in range(1, 3 - len(below))] if len(below) < 2 else []
    diverged_above = any(not math.isfinite(means[lr]) for lr in above)
    if len(above) < 2 and not diverged_above:
        new += [round_lr(lrs[-1] * step ** k) for k in range(1, 3 - len(above))]
    return new


def design_for(plan: dict, seeds: int, seed: int) -> list[dict]:
    """Every planned trial: each (size, batch)'s lrs x seeds, in the plan's order."""
    base = []
    for cell in plan["cells"]:
        for lr in sorted(cell["lrs"]):
            base.append({"trial_id": cell_id(cell["size"], lr, cell["batch_size"]), **CONTROL, "lr": lr,
                         "batch_size": cell["batch_size"], "size": cell["size"]})
    return replicate(base, seeds, True, seed)


def load_plan(out_dir: Path) -> dict:
    path = out_dir / PLAN_FILE
    if not path.is_file():
        return {"cells": []}
    try:
        plan = json.loads(path.read_text())
        if not isinstance(plan, dict) or not isinstance(plan.get("cells"), list):
            raise ValueError("not a plan")
        return plan
    except ValueError:
        raise UserError(f"{path} is damaged, so the grids this scan already chose are unknown; restore it or "
                        "pick a new --output_dir") from None


def run_scan(cfg, out_dir: Path, seeds: int, run_design: Callable[[list[dict]], list[dict]]) -> list[dict]:
    """Run the scan size by size; `run_design(design)` runs what is pending and returns every finished row."""
    sizes = scan_sizes(cfg)
    n_of = {size: size_parameters(size, cfg.model) for size in sizes}
    batches = [int(b) for b in (cfg.batch_sizes or [4])]
    plan = load_plan(out_dir)
    plan.update(sizes=sizes, n_params=n_of, step=cfg.lr_step, points=cfg.lr_points, held_out=sizes[-1])
    rows = _flat(run_design(design_for(plan, seeds, cfg.seed))) if plan["cells"] else []
    for size in sizes:
        for batch in batches:
            cell = next((c for c in plan["cells"] if c["size"] == size and c["batch_size"] == batch), None)
            if cell is None:
                start = running_centre(cfg, size, batch, rows, n_of)
                lrs = sorted(round_lr(lr) for lr in cfg.lrs) if cfg.lrs else centred_grid(start["centre"], cfg.lr_points,
                                                                                            cfg.lr_step)
                cell = {"size": size, "batch_size": batch, **start, "extensions": 0, "lrs": lrs}
                plan["cells"].append(cell)
                atomic_write_json(out_dir / PLAN_FILE, plan)
                print(f"scan: {size} batch {batch}: {len(cell['lrs'])} lrs centred on {start['centre']:.3g} "
                      f"({start['source']})", flush=True)
        rows = _run_size(cfg, out_dir, plan, size, seeds, run_design)
    return run_design(design_for(plan, seeds, cfg.seed))


def _run_size(cfg, out_dir: Path, plan: dict, size: str, seeds: int, run_design) -> list[dict]:
    while True:
        rows = _flat(run_design(design_for(plan, seeds, cfg.seed)))
        feasible_ids = {r["trial_id"] for r in _feasible(rows)}
        grew = False
        for cell in (c for c in plan["cells"] if c["size"] == size):
            trials = [r for r in rows if str(r.get("size")) == size and finite(r.get("batch_size")) == cell["batch_size"]]
            new = [lr for lr in extension(trials, feasible_ids, cfg.lr_step) if lr not in cell["lrs"]]
            if new and cell["extensions"] < cfg.max_lr_extensions:
                cell["lrs"] = sorted(cell["lrs"] + new)
                cell["extensions"] += 1
                grew = True
                print(f"scan: {size} batch {cell['batch_size']}: minimum near the grid edge; adding lrs "
                      f"{', '.join(f'{lr:.3g}' for lr in new)}", flush=True)
            elif new:
                cell["unresolved_edge"] = True
        atomic_write_json(out_dir / PLAN_FILE, plan)
        if not grew:
            return rows
