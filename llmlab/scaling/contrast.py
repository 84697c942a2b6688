"""The lab's optimizer and schedule contrasts: each arm (an optimizer with a schedule) at its own best lr, compared at
equal wall time, in two stages run by `sweep.py --grid <the grid it writes>`. Part of the scaling study: it judges
the lab's runs with the study's lr_opt estimator.

1. `sweep.py contrast plan`: a grid of each arm's lr scan on one probe. An arm whose step costs more (Muon's
   Newton-Schulz) trains fewer steps, so that every arm gets the reference arm's wall time: --steps x (the
   reference's seconds per step / the arm's), from a side-by-side step-time measurement (bench/muon_overhead.py's
   `medians.<optimizer>.step`). The steps ride on the size label (WIDTHxDEPTH@STEPS).
2. `sweep.py contrast confirm`: each arm's lr_opt from its scan by the scaling study's estimator
   (llmlab.scaling.optimum, one cell per arm), then a grid of every arm at its own lr with fresh seeds. Fresh
   seeds, because the loss at a minimum picked from the same runs is biased low (the winner's curse), and more so
   for a noisier arm. Blind by rule, as a scan's held-out size is: the chosen lrs are written to
   contrast_lrs.json, and the confirmation grid is written only once that file is committed as it is on disk.
3. `sweep.py contrast report`: per seed (one seed gives every arm the same init and data order: a block), each
   arm's final validation loss minus the reference arm's; the mean difference with its t interval on K - 1 df and
   p-values Holm-corrected over the arms (llmlab.sweep.stats.holm).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml
from scipy import stats

from llmlab.core.config import opt, parse_config
from llmlab.core.errors import UserError
from llmlab.core.identity import committed_as_is
from llmlab.core.io import atomic_write_json, atomic_write_text
from llmlab.scaling.fits import ScalingOptions, feasible_region
from llmlab.scaling.transfer import seed_noise, size_points
from llmlab.sweep.design import parse_size
from llmlab.sweep.report import flat_row
from llmlab.sweep.spec import load_results
from llmlab.sweep.stats import holm
from llmlab.train.components import OPTIMIZERS, SCHEDULES

STAGES = ("plan", "confirm", "report")
CHOICE_FILE = "contrast_lrs.json"


@dataclass
class ContrastConfig:
    arms: list[str] = opt(
        ["adamw:cosine", "muon:cosine", "adamw:wsd"],
        "OPTIMIZER:SCHEDULE arms, the first the reference every other is compared with",
    )
    size: str = opt("128x12", "plan: the probe WIDTHxDEPTH (GPT-2 heads of 64)")
    model: str = opt("gpt2", "plan: the model family of the probe (gpt2 or minimal)")
    steps: int = opt(300, "plan: the reference arm's optimizer steps; the others get its wall time")
    batch_size: int = opt(4, "plan: sequences per step (the lab's GPT-2 scans: 4)")
    clip: float = opt(2.0, "plan: max grad norm of every trial (the lab's GPT-2 scans: 2.0)")
    lrs: list[float] = opt(
        [p * 2e-3 for p in (0.25, 0.354, 0.5, 0.707, 1.0, 1.41, 2.0, 2.83)], "plan: the lrs each arm scans"
    )
    step_times: Optional[str] = opt(
        None, "plan: JSON of side-by-side seconds per step (medians.<optimizer>.step); none = equal steps"
    )
    replicates: int = opt(3, "plan: seeds per (arm, lr); confirm: fresh seeds per arm")
    seed: int = opt(1000, "confirm: the first fresh seed (away from the scan's)")
    from_dir: Optional[str] = opt(None, "confirm / report: the sweep folder of the stage before")
    output: Optional[str] = opt(
        None, "plan / confirm: the grid YAML to write; report: the JSON (default in --from_dir)"
    )
    confidence: float = opt(0.95, "report: the level of every interval")
    registration_check: str = opt(
        "commit",
        "confirm: write the confirmation grid only once the chosen lrs are committed to git (commit), or "
        "outside git without that rule (none: the report says so)",
        choices=("commit", "none"),
    )


def parse_arm(arm: str) -> dict:
    optimizer, _, schedule = arm.partition(":")
    if optimizer not in OPTIMIZERS or schedule not in SCHEDULES:
        raise UserError(
            f"--arms {arm!r}: give OPTIMIZER:SCHEDULE, an optimizer of {', '.join(OPTIMIZERS)} and a schedule of "
            f"{', '.join(SCHEDULES)}"
        )
    return {"optimizer": optimizer, "scheduler": schedule}


def arm_name(row: dict) -> str:
    return f"{row['optimizer']}:{row['scheduler']}"


def equal_time_steps(steps: int, arms: list[dict], step_times: Optional[dict]) -> dict[str, int]:
    """Each arm's steps for the reference arm's wall time (schedules cost nothing: only the optimizer counts)."""
    if step_times is None:
        return {arm_name(a): steps for a in arms}
    medians = step_times.get("medians", {})
    missing = sorted({a["optimizer"] for a in arms} - set(medians))
    if missing:
        raise UserError(f"--step_times has no median step time of {', '.join(missing)}; measure every arm's optimizer")
    reference = medians[arms[0]["optimizer"]]["step"]
    return {arm_name(a): max(1, round(steps * reference / medians[a["optimizer"]]["step"])) for a in arms}


def _grid(trials: list[dict], replicates: int, note: str) -> str:
    body = yaml.safe_dump({"trials": trials, "replicates": replicates, "replicate_all": True}, sort_keys=False)
    return f"# {note}\n{body}"


def plan(cfg: ContrastConfig) -> str:
    arms = [parse_arm(a) for a in cfg.arms]
    parse_size(cfg.size, cfg.model)
    step_times = json.loads(Path(cfg.step_times).read_text()) if cfg.step_times else None
    steps = equal_time_steps(cfg.steps, arms, step_times)
    trials = [
        {
            "trial_id": f"{arm['optimizer']}-{arm['scheduler']}-lr{lr:.3g}",
            **arm,
            "lr": float(f"{lr:.3g}"),
            "size": f"{cfg.size}@{steps[arm_name(arm)]}",
            "batch_size": cfg.batch_size,
            "clip": cfg.clip,
        }
        for arm in arms
        for lr in cfg.lrs
    ]
    note = "each arm's lr scan at equal wall time: " + ", ".join(f"{name} {n} steps" for name, n in steps.items())
    return _grid(trials, cfg.replicates, note)


def stage_rows(folder: Path) -> list[dict]:
    """The finished trials of a stage's sweep folder, as flat rows."""
    design_path = folder / "design.json"
    if not design_path.is_file():
        raise UserError(f"--from_dir {folder} holds no sweep (no design.json); run the stage's grid first")
    design = json.loads(design_path.read_text())
    return [flat_row(r) for r in load_results(folder, design, rerun=False)]


def arm_optima(rows: list[dict], confidence: float = 0.95) -> dict[str, dict]:
    """Each arm's lr_opt with its interval: the scaling study's estimator with one cell per arm."""
    # each arm a cell of its own; size_points orders cells by N, which arms on one probe share
    cells = [{**r, "size": arm_name(r), "n_params": 1.0} for r in rows if r.get("optimizer")]
    feasible = feasible_region(cells, ScalingOptions(unstable_std=math.inf))[0]
    return {p["size"]: p for p in size_points(feasible, seed_noise(feasible), confidence)}


def confirm(cfg: ContrastConfig) -> str:
    folder = Path(cfg.from_dir or "")
    rows = stage_rows(folder)
    optima = arm_optima(rows, cfg.confidence)
    unmeasured = {a: optima.get(a, {}).get("status", "no trials") for a in cfg.arms}
    unmeasured = {a: s for a, s in unmeasured.items() if s != "measured"}
    if unmeasured:
        raise UserError(
            "no lr_opt for "
            + ", ".join(f"{a} ({s})" for a, s in unmeasured.items())
            + ": extend that arm's lrs past its edge and run the scan again"
        )
    kept = ("size", "batch_size", "clip")  # what the scan trained each arm with, kept for its confirmation
    setting = {arm_name(r): {k: r[k] for k in kept} for r in rows if r.get("optimizer")}
    choice = {a: {"lr": float(f"{optima[a]['lr_opt']:.3g}"), "ci": optima[a]["ci"], **setting[a]} for a in cfg.arms}
    commit = register_choice(folder / CHOICE_FILE, choice, cfg.registration_check)
    trials = [
        {"trial_id": a.replace(":", "-"), **parse_arm(a), **{k: c[k] for k in ("lr", *kept)}, "seed": cfg.seed}
        for a, c in choice.items()
    ]
    where = f"registered in {folder / CHOICE_FILE} at commit {commit}" if commit else "not registered (none)"
    return _grid(
        trials, cfg.replicates, f"every arm at its own lr_opt from {folder}, fresh seeds from {cfg.seed}; {where}"
    )


def register_choice(path: Path, choice: dict, check: str) -> Optional[str]:
    """Write the chosen lrs (once: a later confirm must choose the same) and return the commit that holds them as
    they are on disk; uncommitted, stop in one line before any confirmation grid exists."""
    if path.is_file() and json.loads(path.read_text()) != json.loads(json.dumps(choice)):
        raise UserError(
            f"{path} registered other lrs than this scan now gives; the confirmation judges the registered ones "
            "(restore the scan's trials, or confirm in a new folder)"
        )
    if not path.is_file():
        atomic_write_json(path, choice)
    commit, why = committed_as_is(path)
    if commit is None and check == "commit":
        raise UserError(
            f"{path} registers each arm's lr and {why}, so the confirmation grid waits (blind by commit): run "
            f"`git add {path} && git commit`, then this command again (outside git: --registration_check none)"
        )
    return commit


def paired_contrasts(rows: list[dict], arms: list[str], confidence: float = 0.95) -> list[dict]:
    """Each arm minus the reference (arms[0]) in final validation loss, paired by seed; a t interval on the pairs'
    K - 1 df, Holm-adjusted p-values over the arms. A seed missing (or not finite) in either arm drops its pair."""
    loss = {}
    for r in rows:
        value = r.get("final_loss")
        if r.get("status") == "ok" and isinstance(value, (int, float)) and math.isfinite(value):
            loss[(arm_name(r), int(r["seed"]))] = float(value)
    reference, out = arms[0], []
    for arm in arms[1:]:
        pairs = [loss[(arm, s)] - loss[(reference, s)] for (a, s) in loss if a == arm and (reference, s) in loss]
        k = len(pairs)
        if k < 2:
            out.append({"arm": arm, "reference": reference, "pairs": k, "status": "too few pairs", "p": math.nan})
            continue
        mean = sum(pairs) / k
        sd = math.sqrt(sum((d - mean) ** 2 for d in pairs) / (k - 1))
        se, df = sd / math.sqrt(k), k - 1
        half = stats.t.ppf((1 + confidence) / 2, df) * se
        p = float(2 * stats.t.sf(abs(mean / se), df)) if se > 0 else (0.0 if mean else 1.0)
        out.append(
            {"arm": arm, "reference": reference, "pairs": k, "difference": mean, "ci": [mean - half, mean + half]}
            | {"df": df, "sd": sd, "p": p, "status": "ok"}
        )
    adjusted = holm([c["p"] for c in out if c["status"] == "ok"])
    for contrast, p in zip((c for c in out if c["status"] == "ok"), adjusted):
        contrast["p_holm"] = p
        contrast["resolved"] = p < 1 - confidence
    return out


def grid_note(folder: Path) -> str:
    """What the stage's grid says of itself (its first line: for a confirmation, where its lrs were registered)."""
    config = folder / "config.yaml"
    grid = Path(str((yaml.safe_load(config.read_text()) or {}).get("grid", ""))) if config.is_file() else None
    if grid is None or not grid.is_file():
        return "unknown (the stage's grid file is not where its config.yaml says)"
    return grid.read_text().splitlines()[0].lstrip("# ")


def report(cfg: ContrastConfig) -> dict:
    folder = Path(cfg.from_dir or "")
    rows = stage_rows(folder)
    contrasts = paired_contrasts(rows, cfg.arms, cfg.confidence)
    result = {"arms": cfg.arms, "reference": cfg.arms[0], "confidence": cfg.confidence, "contrasts": contrasts}
    result["grid"] = grid_note(folder)
    print(f"grid: {result['grid']}")
    atomic_write_json(Path(cfg.output) if cfg.output else folder / "contrasts.json", result)
    level = f"{cfg.confidence:.0%}"
    print(f"| arm | minus {cfg.arms[0]} (val loss) | {level} CI | df | p (Holm) |\n|---|---|---|---|---|")
    for c in contrasts:
        if c["status"] != "ok":
            print(f"| {c['arm']} | {c['status']} ({c['pairs']} pairs) | | | |")
            continue
        print(
            f"| {c['arm']} | {c['difference']:+.4f} | [{c['ci'][0]:+.4f}, {c['ci'][1]:+.4f}] | {c['df']} | "
            f"{c['p_holm']:.3g}{' (resolved)' if c['resolved'] else ''} |"
        )
    return result


def contrast_main(argv: list[str]) -> Optional[dict]:
    if not argv or argv[0] not in STAGES:
        raise UserError(f"sweep.py contrast takes a stage first: {' | '.join(STAGES)} (then --help)")
    stage, cfg = argv[0], parse_config(ContrastConfig, argv[1:], description=__doc__.split("\n")[0])
    if len(cfg.arms) < 2:
        raise UserError("--arms: give a reference and at least one arm to compare with it")
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.replicates < 2 or not 0 < cfg.confidence < 1:
        raise UserError(
            "--steps and --batch_size must be >= 1, --replicates >= 2 (a seed SD needs two) and --confidence in "
            f"(0, 1); got {cfg.steps}, {cfg.batch_size}, {cfg.replicates}, {cfg.confidence}"
        )
    if not cfg.lrs or any(not (math.isfinite(lr) and lr > 0) for lr in cfg.lrs):
        raise UserError(f"--lrs must be learning rates > 0, got {cfg.lrs}")
    if stage != "plan" and not cfg.from_dir:
        raise UserError(f"sweep.py contrast {stage} reads a finished stage: pass --from_dir <its sweep folder>")
    if stage == "report":
        return report(cfg)
    text = plan(cfg) if stage == "plan" else confirm(cfg)
    output = Path(cfg.output or ("contrast_scan.yaml" if stage == "plan" else Path(cfg.from_dir) / "confirm.yaml"))
    atomic_write_text(output, text)
    print(f"wrote {output}: run it with `python sweep.py --grid {output} --model <the probe's> --output_dir ...`")
    return None
