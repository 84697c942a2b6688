"""The scaling study's runs: `--grid lr_bs`, analysed by the scaling fits, and the adaptive multi-size lr scan
(`--grid lr_bs --sizes ...`), each a `Study` the lab's runner (llmlab.sweep.runner) drives.

Sizes run in order of N. Each size's lr grid (--lr_points lrs, a factor --lr_step apart) is centred on the running
forecast: the law fitted on the sizes already measured (two or more), the one measured optimum, or --lr_center for
the first size. After a size's trials finish, a grid whose seed-mean minimum has fewer than two scanned lrs on
either side is extended past that edge (a side whose larger lrs diverged needs no extension: divergence bounds it),
up to --max_lr_extensions times, so an optimum on the grid edge is never taken for a measurement. Every grid is
written to scan_plan.json before it runs: a rerun resumes with the same grids, and the held-out size's forecast is
on disk before its first trial.

A scan across training length (`--sizes 128x12@150 128x12@300 ...`: one probe, each size its own steps) is the same
scan with the training tokens D in place of N: its law is ln lr_opt = a + beta ln D (llmlab.scaling.length), its
held-out length is forecast and registered the same way, and its null "the optimum does not move with length" is
registered beside the law (as muP's flat forecast is for width). Warmup keeps its share of each run
(runner.warmup_scale) and the schedule decays over the run: a rule of the run's length, not a fixed step count.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from llmlab.core.device import cpu_has_fast_bf16
from llmlab.core.errors import UserError, Waiting
from llmlab.core.identity import committed_as_is, file_sha256
from llmlab.core.io import atomic_write_json
from llmlab.core.runinfo import machine_label
from llmlab.models.registry import model_facts
from llmlab.scaling.fits import ScalingOptions, feasible_region
from llmlab.scaling.law import fit_law, predict
from llmlab.scaling.machines import MACHINE_RULE, machine_adjust
from llmlab.scaling.optimum import ESTIMATOR, SAME_VERDICT, cell_optimum, finite, grid_extension
from llmlab.scaling.report import write_lr_bs_report
from llmlab.scaling.transfer import BAND, VERDICT_RULE, flat_forecast, seed_noise, sigma_model, size_points
from llmlab.sweep.design import CONTROL, in_blocks, parse_size, replicate, size_steps
from llmlab.sweep.report import flat_row
from llmlab.sweep.runner import Study, trial_device

PLAN_FILE = "scan_plan.json"
PREREGISTRATION = "preregistration.json"
DEFAULT_SEEDS = 2  # seeds per (size, lr) of a multi-size scan: the pure error behind every vertex's interval
DEFAULT_CENTER = {"minimal": 3e-3, "gpt2": 1e-3}
DEFAULT_SIZES = {
    "minimal": ["32x2", "64x2", "96x2", "128x2", "160x2", "320x2"],
    # heads of 64 at GPT-2 124M's depth; 320x12 held out at 2.8x the largest fit N (the lab's GPT-2 muP scan)
    "gpt2": ["64x12", "128x12", "192x12", "320x12"],
}


def round_lr(lr: float) -> float:
    return float(f"{lr:.3g}")


def lr_label(lr: float) -> str:
    mantissa, exponent = f"{lr:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def cell_id(size: str, lr: float, batch: int) -> str:
    return f"{size}_lr{lr_label(lr)}_bs{batch}"


def centred_grid(centre: float, points: int, step: float) -> list[float]:
    return [round_lr(centre * step ** (k - (points - 1) / 2)) for k in range(points)]


def size_parameters(size: str, model: str, head_dim: int = 32) -> int:
    """Non-embedding N of one scanned size, from the model registry (built on the meta device: no memory, no time)."""
    width, depth = parse_size(size, model, head_dim)
    # any sequence length: N leaves the position table out, and the minimal Transformer's RoPE has none
    return model_facts(model, width, depth, 1024, head_dim=head_dim)["non_embedding"]


def scan_sizes(cfg) -> list[str]:
    """The scan's sizes in the order it runs them: by N, or (a scan across lengths) by steps."""
    family = "minimal" if cfg.model == "minimal" else "gpt2"
    sizes = DEFAULT_SIZES[family] if cfg.sizes == ["default"] else list(cfg.sizes)
    return sorted(sizes, key=lambda s: (size_parameters(s, cfg.model, cfg.head_dim), size_steps(s) or 0))


def scan_axis(sizes: list[str]) -> str:
    """What the scan varies: "params" (widths, N) or "tokens" (one probe's training lengths, D)."""
    return "tokens" if any(size_steps(s) for s in sizes) else "params"


def scan_scale(cfg, sizes: list[str], batch: int) -> dict[str, float]:
    """Each size's place on the law's axis: non-embedding N, or for a scan across lengths its training tokens D
    (steps x batch x block), the x of ln lr_opt = a + beta ln D."""
    if scan_axis(sizes) == "params":
        return {size: size_parameters(size, cfg.model, cfg.head_dim) for size in sizes}
    block = cfg.block_size or cfg.budget_spec.block_size
    return {size: size_steps(size) * batch * block for size in sizes}


def on_axis(rows: list[dict], plan: dict) -> list[dict]:
    """Rows placed on the scan's axis: a scan across lengths fits on D, so each row's n_params is its training tokens
    (the model's own N kept as n_params_model)."""
    if plan.get("axis") != "tokens":
        return rows
    return [
        {**row, "n_params_model": row.get("n_params_model", row.get("n_params")), "n_params": row["train_tokens"]}
        for row in rows
    ]


def _feasible(rows: list[dict], plan: dict) -> list[dict]:
    """Trials that finished with a finite loss below the uniform guess, each machine's offset removed (a scan's
    decisions see one machine's curve, as its report does). No relative "unstable" rule here: a run whose early
    loss moved a lot still measured its final loss, and dropping it would bias the vertex."""
    feasible = feasible_region(rows, ScalingOptions(unstable_std=math.inf))[0]
    return machine_adjust(feasible, machine_order(plan))[0]


def _flat(results: list[dict], plan: dict) -> list[dict]:
    """Results as table rows, each with the numerics group of the CPU it ran on (`machine`)."""
    return with_machines([flat_row(r) for r in results], plan)


def with_machines(rows: list[dict], plan: dict) -> list[dict]:
    groups = machine_groups(plan)
    return on_axis([{**row, "machine": groups.get(str(row.get("cpu")), row.get("cpu"))} for row in rows], plan)


def machine_order(plan: dict) -> list[str]:
    """The numerics groups in the order the scan met them: the first is every machine term's reference."""
    return list(dict.fromkeys(m["numerics"] for m in plan.get("machines", [])))


def running_centre(cfg, size: str, batch: int, rows: list[dict], n_of: dict[str, int], plan: dict) -> dict:
    """Where this size's grid is centred: the law on the sizes measured so far (the report's own estimator), one
    size's optimum, or the configured centre; with the forecast's interval when there is one."""
    feasible = [r for r in _feasible(rows, plan) if float(r["batch_size"]) == batch]
    measured = [p for p in size_points(feasible, seed_noise(feasible)) if p["status"] == "measured"]
    if len(measured) >= 3:
        law = fit_law(measured, with_batch=False)
        if law["status"] == "ok":
            forecast = predict(law, n_of[size], batch)
            return {
                "centre": forecast["lr"],
                "source": f"law fitted on {', '.join(law['sizes'])}",
                "prediction_interval": forecast["pi"],
                "alpha": law["alpha"],
                "law": {
                    "params": law["params"],
                    "cov": law["cov"],
                    "df": law["df"],
                    "tau2": law["tau2"],
                    "ln_lr": forecast["ln_lr"],
                    "se_mean": forecast["se_mean"],
                    "se_pred": forecast["se_pred"],
                    "sizes": law["sizes"],
                },
            }
    if len(measured) == 2:  # a line through two optima: a forecast without an interval
        (a, b) = sorted(measured, key=lambda m: m["n_params"])
        slope = (b["ln_lr_opt"] - a["ln_lr_opt"]) / math.log(b["n_params"] / a["n_params"])
        return {
            "centre": math.exp(b["ln_lr_opt"] + slope * math.log(n_of[size] / b["n_params"])),
            "source": f"line through the optima of {a['size']} and {b['size']}",
        }
    if measured:
        return {"centre": measured[0]["lr_opt"], "source": f"optimum measured at {measured[0]['size']}"}
    lr = cfg.lr_center or DEFAULT_CENTER["minimal" if cfg.model == "minimal" else "gpt2"]
    return {"centre": lr, "source": "--lr_center" if cfg.lr_center else "default centre"}


def extension(trials: list[dict], feasible_ids: set, step: float, status: str = "measured") -> list[float]:
    """lrs to add to one cell (optimum.grid_extension): a seed-mean minimum with fewer than two scanned lrs on a
    side, or a side the vertex's bootstrap leaves open (`status` censored_low / censored_high)."""
    lrs = sorted({float(t["lr"]) for t in trials})
    means = []
    for lr in lrs:
        losses = [float(t["final_loss"]) for t in trials if float(t["lr"]) == lr and t["trial_id"] in feasible_ids]
        means.append(float(np.mean(losses)) if losses else math.inf)
    return grid_extension(lrs, means, status, step)


def design_for(plan: dict, seeds: int, seed: int) -> list[dict]:
    """Every planned trial: each (size, batch)'s lrs x its seeds (the cell's own count, else `seeds`), sorted by lr,
    each cell's seeds in blocks (design.in_blocks) shuffled from the plan's recorded order seed."""
    design, order_seed = [], int(plan.get("order_seed", seed))
    for index, cell in enumerate(plan["cells"]):
        base = [
            {
                "trial_id": cell_id(cell["size"], lr, cell["batch_size"]),
                **CONTROL,
                "lr": lr,
                "batch_size": cell["batch_size"],
                "size": cell["size"],
            }
            for lr in sorted(cell["lrs"])
        ]
        trials = replicate(base, cell.get("seeds", seeds), True, seed)
        if cell["size"] == plan.get("held_out") and plan.get("registration"):
            trials = [{**t, "registration": plan["registration"]} for t in trials]  # result.json keeps it
        design += in_blocks(trials, order_seed, index, f"{cell['size']}/bs{cell['batch_size']}/")
    return design


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
        raise UserError(
            f"{path} is damaged, so the grids this scan already chose are unknown; restore it or "
            "pick a new --output_dir"
        ) from None


def scan_precision(cfg, out_dir: Path, resolved: str, device: str) -> str:
    """The precision every trial of this scan trains in: the one its first run chose (a resume on another machine
    keeps it, else auto would change the numerics mid-scan). A bf16 scan on a CPU whose bf16 is emulated is refused
    before anything is written: its trials would take tens of times longer."""
    plan = load_plan(out_dir)
    precision = plan.get("precision") or _recorded_precision(out_dir, plan) or resolved
    if precision == "bf16" and device == "cpu" and not cpu_has_fast_bf16():
        raise UserError(
            f"this scan trains in bf16 and {machine_label()} has no bf16 units (bf16 would be emulated, "
            "tens of times slower): run it on a CPU with AVX512-BF16 or AMX, or start an fp32 scan "
            "(--precision fp32) in a new --output_dir"
        )
    return precision


def _recorded_precision(out_dir: Path, plan: dict) -> Optional[str]:
    """A scan from before the plan kept its precision: what its first finished trial ran in."""
    for trial in design_for(plan, DEFAULT_SEEDS, 0):
        try:
            return json.loads((out_dir / "trials" / trial["trial_id"] / "result.json").read_text())["precision"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def machine_groups(plan: dict) -> dict[str, str]:
    """CPU label -> the numerics it shares: machines whose replay of a finished trial was bit-identical share one
    group (and need no machine term between them)."""
    return {m["label"]: m["numerics"] for m in plan.get("machines", [])}


def _known_machines(plan: dict, out_dir: Path) -> list[dict]:
    """plan["machines"], adopting a scan from before machines were listed (its one pinned machine)."""
    if "machines" not in plan:
        label = plan.pop("machine", None)
        if label is None and plan["cells"]:
            try:
                hardware = json.loads((out_dir / "run_info.json").read_text()).get("hardware", {})
            except (OSError, ValueError):
                hardware = {}
            label = hardware.get("machine") or f"{hardware.get('cpu_model') or 'a CPU'} (not fully recorded)"
        plan["machines"] = [{"label": label, "numerics": label, "replay": None}] if label else []
    return plan["machines"]


def admit_machine(
    cfg,
    plan: dict,
    out_dir: Path,
    seeds: int,
    finished: Callable[[list[dict]], list[dict]],
    replay: Callable[[dict, Path], dict],
) -> None:
    """A machine the scan has not seen first replays one finished trial (the quickest). Bit-identical (same final
    loss and loss curve): it shares the numerics and the scan simply goes on. Otherwise it is a new machine: every
    cell it finds part-done gets --new_machine_blocks complete blocks, and the analysis fits a machine term. A new
    machine that finds no cell part-done (it joined between sizes) gets them at the last fit size that ran: a bridge,
    without which its offset and tilt would be confounded with the sizes it runs alone."""
    machines, here = _known_machines(plan, out_dir), machine_label()
    known = next((m for m in machines if m["label"] == here), None)
    if known is not None:
        if known["numerics"] == here and machine_order(plan)[0] != here and not _has_blocks(plan, here):
            _late_bridge(cfg, plan, seeds, finished, here)  # admitted between sizes by a scan from before bridges
        return
    design = design_for(plan, seeds, cfg.seed)
    done = [r for r in finished(design) if r.get("status") == "ok" and r.get("cpu")]
    if not machines or not done:
        machines.append({"label": here, "numerics": here, "replay": None})
        return
    reference = min(done, key=lambda r: float(r.get("wall_time_s") or math.inf))
    trial = next(t for t in design if t["trial_id"] == reference["trial_id"])
    print(f"scan: {here} is new to this scan; replaying {trial['trial_id']} (run on {reference['cpu']})", flush=True)
    again = replay(trial, out_dir / "replays" / _slug(here) / trial["trial_id"])
    identical = (
        again.get("status") == "ok"
        and again.get("final_loss") == reference.get("final_loss")
        and (again.get("curves") or {}).get("loss") == (reference.get("curves") or {}).get("loss")
    )
    groups = machine_groups(plan)
    record = {
        "trial_id": trial["trial_id"],
        "of": reference["cpu"],
        "identical": identical,
        "final_loss": [reference.get("final_loss"), again.get("final_loss")],
        "status": again.get("status"),
    }
    machines.append(
        {
            "label": here,
            "numerics": groups.get(reference["cpu"], reference["cpu"]) if identical else here,
            "replay": record,
        }
    )
    if identical:
        print(f"scan: the replay is bit-identical; {here} shares the numerics of {reference['cpu']}", flush=True)
        return
    where = _new_machine_blocks(plan, design, {r["trial_id"] for r in done}, seeds, cfg.new_machine_blocks, here)
    print(
        f"scan: the replay differs (final loss {reference.get('final_loss')} -> {again.get('final_loss')}): "
        f"{here} starts new blocks{where}; the analysis fits a machine term",
        flush=True,
    )


def _new_machine_blocks(plan: dict, design: list[dict], finished: set, seeds: int, blocks: int, here: str) -> str:
    """Blocks for a machine with new numerics: in every part-done cell, else a bridge; where, for the log."""
    part_done = [c for c in plan["cells"] if 0 < len(_cell_ids(design, c) & finished) < len(_cell_ids(design, c))]
    added = _add_blocks(part_done, seeds, blocks, here)
    if added:
        return f" ({blocks} per part-done size: {', '.join(added)})"
    added = _bridge(plan, design, finished, seeds, blocks, here)
    return f" ({blocks} at {', '.join(added)}, a bridge: no size was part-done)" if added else ""


def _late_bridge(cfg, plan: dict, seeds: int, finished: Callable[[list[dict]], list[dict]], here: str) -> None:
    design = design_for(plan, seeds, cfg.seed)
    rows = with_machines(finished(design), plan)
    by_others = {r["trial_id"] for r in rows if r.get("status") == "ok" and r["machine"] != here}
    added = _bridge(plan, design, by_others, seeds, cfg.new_machine_blocks, here)
    if added:
        print(f"scan: {here} ran no cell beside another machine; bridge blocks at {added[0]}", flush=True)


def _cell_ids(design: list[dict], cell: dict) -> set:
    return {t["trial_id"] for t in design if t["size"] == cell["size"] and t["batch_size"] == cell["batch_size"]}


def _has_blocks(plan: dict, machine: str) -> bool:
    return any(b["machine"] == machine for c in plan["cells"] for b in c.get("machine_blocks", []))


def _bridge(plan: dict, design: list[dict], finished: set, seeds: int, blocks: int, machine: str) -> list[str]:
    """Blocks for `machine` at the last fit size (not the held-out one) where other machines finished trials
    (`finished`: their ids), every batch of it."""
    ran = [c for c in plan["cells"] if c["size"] != plan.get("held_out") and _cell_ids(design, c) & finished]
    if not ran:
        return []
    order = {size: i for i, size in enumerate(plan.get("sizes", []))}
    last = max(order.get(c["size"], -1) for c in ran)
    return _add_blocks([c for c in ran if order.get(c["size"], -1) == last], seeds, blocks, machine)


def _add_blocks(cells: list[dict], seeds: int, blocks: int, machine: str) -> list[str]:
    """Give each cell `blocks` more complete blocks (new seeds) for `machine`; the sizes that got them."""
    for cell in cells:
        first = cell.get("seeds", seeds)
        cell["seeds"] = first + blocks
        cell.setdefault("machine_blocks", []).append({"machine": machine, "replicates": [first, cell["seeds"] - 1]})
    return list(dict.fromkeys(cell["size"] for cell in cells))


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label).strip("-")[:80]


def run_scan(
    cfg,
    out_dir: Path,
    seeds: int,
    precision: str,
    run_design: Callable[[list[dict]], list[dict]],
    finished: Callable[[list[dict]], list[dict]],
    replay: Callable[[dict, Path], dict],
) -> list[dict]:
    """Run the scan size by size; `run_design(design)` runs what is pending and returns every finished row,
    `finished(design)` only returns them, `replay(trial, folder)` runs one trial again in another folder."""
    sizes = scan_sizes(cfg)
    batches = [int(b) for b in (cfg.batch_sizes or [4])]
    n_of = scan_scale(cfg, sizes, batches[0])  # N, or D for a scan across lengths (one batch size)
    plan = load_plan(out_dir)
    held_out = sizes[-1] if cfg.holdout != "none" and (cfg.holdout == "largest" or len(sizes) >= 3) else None
    check_growth(plan, sizes, held_out, out_dir)
    grow_seeds(plan, held_out, seeds)
    plan.update(sizes=sizes, n_params=n_of, step=cfg.lr_step, points=cfg.lr_points, held_out=held_out)
    if scan_axis(sizes) == "tokens":  # a width scan's plan stays as it was written
        plan["axis"] = "tokens"
    plan.setdefault("order_seed", cfg.seed)
    plan.setdefault("precision", precision)
    admit_machine(cfg, plan, out_dir, seeds, finished, replay)
    atomic_write_json(out_dir / PLAN_FILE, plan)
    registration_gate(cfg, out_dir, plan)  # a registered forecast's trials wait for its commit
    rows = _flat(run_design(design_for(plan, seeds, cfg.seed)), plan) if plan["cells"] else []
    for size in sizes:
        for batch in batches:
            cell = next((c for c in plan["cells"] if c["size"] == size and c["batch_size"] == batch), None)
            if cell is None:
                held = size == held_out
                start = running_centre(cfg, size, batch, rows, n_of, plan)
                points = (cfg.holdout_lr_points or cfg.lr_points) if held else cfg.lr_points
                lrs = (
                    sorted(round_lr(lr) for lr in cfg.lrs)
                    if cfg.lrs
                    else centred_grid(start["centre"], points, cfg.lr_step)
                )
                cell = {
                    "size": size,
                    "batch_size": batch,
                    **start,
                    "extensions": 0,
                    "lrs": lrs,
                    "seeds": (cfg.holdout_replicates or seeds) if held else seeds,
                }
                if held:
                    preregister(cfg, out_dir, plan, cell, rows)
                plan["cells"].append(cell)
                atomic_write_json(out_dir / PLAN_FILE, plan)
                if held:
                    registration_gate(cfg, out_dir, plan)
                print(
                    f"scan: {size} batch {batch}: {len(cell['lrs'])} lrs x {cell['seeds']} seeds centred on "
                    f"{start['centre']:.3g} ({start['source']})",
                    flush=True,
                )
        rows = _run_size(cfg, out_dir, plan, size, seeds, run_design)
    return run_design(design_for(plan, seeds, cfg.seed))


def registration_gate(cfg, out_dir: Path, plan: dict) -> None:
    """A scan with a pre-registration runs its held-out trials only once the file is committed to git as it is on disk:
    blind by rule, not by seconds. plan["registration"] (its commit and sha256) then goes into every held-out trial's
    result.json. Uncommitted, the scan stops here in one line, nothing held out having started; outside git,
    --registration_check none runs them blind by timing only, and says so in each result."""
    path = out_dir / PREREGISTRATION
    if not path.is_file():
        return
    commit, why = committed_as_is(path)
    sha256 = file_sha256(path)
    if commit is None and cfg.registration_check == "commit":
        raise Waiting(
            f"{path} registers the {plan.get('held_out')} forecast and {why}, so its held-out trials wait (blind "
            f"by commit): run `git add {path} && git commit`, then this command again (outside git: "
            "--registration_check none)"
        )
    plan["registration"] = {"commit": commit, "sha256": sha256, "checked": "git" if commit else "none"}
    atomic_write_json(out_dir / PLAN_FILE, plan)


def check_growth(plan: dict, sizes: list[str], held_out: Optional[str], out_dir: Path) -> None:
    """A rerun may add sizes after those the scan planned, and hold the last one out; it may not reorder or drop
    planned sizes, hold out a size that ran as a fit size, or move a registered check."""
    planned = plan.get("sizes") or []
    if sizes[: len(planned)] != planned:
        raise UserError(
            f"{out_dir} scans the sizes {' '.join(planned)}; a rerun may add sizes after them, not change them "
            f"(got {' '.join(sizes)})"
        )
    registered = (out_dir / PREREGISTRATION).is_file()
    if registered and held_out != plan.get("held_out"):
        raise UserError(
            f"{out_dir} registered its check on {plan.get('held_out')}; rerun with that size last and "
            "--holdout auto or largest"
        )
    if held_out and not registered and any(c["size"] == held_out for c in plan["cells"]):
        raise UserError(
            f"{held_out} already ran as a fit size of {out_dir}, so a forecast for it cannot be blind; "
            "add a new, larger size to hold out"
        )


def grow_seeds(plan: dict, held_out: Optional[str], seeds: int) -> None:
    """A larger --replicates adds seeds to the fit sizes' cells as whole blocks (never fewer); the held-out cell keeps
    the count its registration planned."""
    for cell in plan["cells"]:
        if cell["size"] != held_out:
            cell["seeds"] = max(cell.get("seeds", seeds), seeds)


def read_preregistration(out_dir: Path) -> Optional[dict]:
    """The scan's pre-registration with its sha256 and whether today's estimator and verdict rule are the registered
    ones; None when the folder has none."""
    path = out_dir / PREREGISTRATION
    if not path.is_file():
        return None
    try:
        registration = json.loads(path.read_text())
        if not isinstance(registration, dict) or "forecast" not in registration:
            raise ValueError("not a pre-registration")
    except (ValueError, UnicodeDecodeError):
        raise UserError(
            f"{path} is damaged: the held-out verdict has no registered forecast to judge; restore it "
            "from version control (a forecast made now would not be a pre-registration)"
        ) from None
    return {
        **registration,
        "sha256": file_sha256(path),
        "file": PREREGISTRATION,
        "estimator_unchanged": estimator_matches(registration.get("estimator"))
        and registration.get("machine_term") in (None, MACHINE_RULE),
        "rule_unchanged": registration.get("verdict_rule") == VERDICT_RULE,
    }


def estimator_matches(recorded) -> bool:
    """Whether a registration's estimator gives today's verdict: today's, or an earlier version with the same vertex
    and variance (optimum.SAME_VERDICT: only the displayed interval changed since)."""
    if recorded == ESTIMATOR:
        return True
    return isinstance(recorded, dict) and recorded.get("name") in SAME_VERDICT


def held_out_trials(size: str, model: str, folders: list[Path]) -> list[Path]:
    """Every finished trial of this size and model under the folders (their */trials/*/result.json, at any depth)."""
    found = []
    for folder in folders:
        for path in sorted(Path(folder).glob("**/trials/*/result.json")) if Path(folder).is_dir() else []:
            try:
                result = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if str((result.get("hparams") or {}).get("size")) == size and result.get("model", model) == model:
                found.append(path)
    return found


def _design_rationale(cfg) -> Optional[dict]:
    if not cfg.design_rationale:
        return None
    try:
        return json.loads(Path(cfg.design_rationale).read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"--design_rationale {cfg.design_rationale}: not a readable JSON file ({err})") from None


def preregister(cfg, out_dir: Path, plan: dict, cell: dict, rows: list[dict]) -> None:
    """Before the held-out size's first trial: its forecast and prediction interval, the estimator, the verdict rule
    and the design, in one file whose sha256 the report prints. The verdict is judged against this forecast."""
    path = out_dir / PREREGISTRATION
    if path.exists():
        return
    seen = held_out_trials(cell["size"], cfg.model, [out_dir, *map(Path, cfg.blind_to)])
    if seen:
        raise UserError(
            f"cannot pre-register a forecast of {cell['size']}: {len(seen)} trial(s) of that size already "
            f"exist ({seen[0]}), so it would not be blind; hold out a size no trial has run (or take those "
            "folders out of --blind_to if they are another model)"
        )
    held_rows = [r for r in rows if str(r.get("size")) == cell["size"]]
    same_batch = [r for r in rows if float(r["batch_size"]) == cell["batch_size"]]  # the law's forecast is per batch
    fit = _feasible([r for r in same_batch if str(r.get("size")) != cell["size"]], plan)
    atomic_write_json(
        path,
        {
            "written_before_held_out_trials": not held_rows,
            "held_out": cell["size"],
            "batch_size": cell["batch_size"],
            "n_params": plan["n_params"][cell["size"]],
            "forecast": {
                "lr": cell["centre"],
                "prediction_interval": cell.get("prediction_interval"),
                "source": cell["source"],
                "alpha": cell.get("alpha"),
                "law": cell.get("law"),
            },
            "flat_forecast": _flat_forecast(cfg, plan, fit),
            "axis": plan.get("axis", "params"),
            "estimator": ESTIMATOR,
            "machine_term": MACHINE_RULE,  # the held-out size may well run on several machines: say how, now
            "verdict_rule": VERDICT_RULE,
            "band": BAND,
            "design": {
                "fit_cells": [
                    {k: c[k] for k in ("size", "batch_size", "lrs", "seeds", "extensions")} for c in plan["cells"]
                ],
                "held_out_lrs": cell["lrs"],
                "held_out_seeds": cell["seeds"],
                "lr_step": cfg.lr_step,
                "max_lr_extensions": cfg.max_lr_extensions,
                "budget": cfg.budget,
                "steps": cfg.steps,
                "head_dim": cfg.head_dim,
                "parametrization": cfg.parametrization,
            },
            "machine": machine_label(),  # the one writing it; plan["machines"] lists every machine the scan met
            "machines": plan["machines"],
            "fit_trials": len(rows),
            "design_rationale": _design_rationale(cfg),
        },
    )
    print(
        f"scan: pre-registered the {cell['size']} forecast {cell['centre']:.3g} in {path} "
        f"(sha256 {file_sha256(path)[:16]})",
        flush=True,
    )


def _flat_forecast(cfg, plan: dict, fit: list[dict]) -> Optional[dict]:
    """The prediction registered beside the law's where the scan has one: muP's (the optimum does not move with
    width), and a length scan's null (it does not move with length)."""
    if cfg.parametrization == "mup" or plan.get("axis") == "tokens":
        return flat_forecast(size_points(fit, seed_noise(fit)))
    return None


def _run_size(cfg, out_dir: Path, plan: dict, size: str, seeds: int, run_design) -> list[dict]:
    while True:
        rows = _flat(run_design(design_for(plan, seeds, cfg.seed)), plan)
        feasible = _feasible(rows, plan)
        feasible_ids = {r["trial_id"] for r in feasible}
        sigma = sigma_model(seed_noise(feasible), size)
        grew = False
        for cell in (c for c in plan["cells"] if c["size"] == size):
            # the lrs of every trial (a diverged lr counts), the machine-adjusted losses of the feasible ones
            trials = [
                r
                for r in feasible + [r for r in rows if r["trial_id"] not in feasible_ids]
                if str(r.get("size")) == size and finite(r.get("batch_size")) == cell["batch_size"]
            ]
            status = cell_optimum([r for r in trials if r["trial_id"] in feasible_ids], sigma)["status"]
            new = [lr for lr in extension(trials, feasible_ids, cfg.lr_step, status) if lr not in cell["lrs"]]
            if new and cell["extensions"] < cfg.max_lr_extensions:
                cell["lrs"] = sorted(cell["lrs"] + new)
                cell["extensions"] += 1
                grew = True
                print(
                    f"scan: {size} batch {cell['batch_size']}: minimum near the grid edge; adding lrs "
                    f"{', '.join(f'{lr:.3g}' for lr in new)}",
                    flush=True,
                )
            elif new:
                cell["unresolved_edge"] = True
        atomic_write_json(out_dir / PLAN_FILE, plan)
        if not grew:
            return rows


# A multi-size scan may grow: sizes after the ones it ran, and the held-out check of the last one with its design,
# may be added once the fit sizes have run (so the check's power can be simulated from their noise). What ran is
# kept in scan_plan.json, and check_growth refuses a change to it.
SCAN_GROWTH_OPTIONS = frozenset({"sizes", "holdout", "holdout_lr_points", "holdout_replicates", "design_rationale"})


class LrStudy(Study):
    """`--grid lr_bs` at one size: the lab's fixed lr x batch design, analysed by the scaling fits (and, for a scan,
    the held-out check across sizes). A scan's rows carry the numerics group of their machine (machines that replayed
    bit-identically share one)."""

    def analyse(self, cfg, out_dir: Path, rows: list[dict]) -> None:
        plan = load_plan(out_dir)
        registration, order = read_preregistration(out_dir), machine_order(plan) or None
        options = ScalingOptions(holdout=cfg.holdout, preregistration=registration, machine_order=order)
        length = plan.get("axis") == "tokens"
        write_lr_bs_report(out_dir, with_machines([flat_row(r) for r in rows], plan), options, length_law=length)


class ScanStudy(LrStudy):
    """The multi-size scan: its grids are planned as it runs (scan_plan.json), its precision is pinned for every
    machine, and it may grow (SCAN_GROWTH_OPTIONS)."""

    growth_options = SCAN_GROWTH_OPTIONS
    plans_as_it_runs = True

    def precision(self, cfg, out_dir: Path) -> Optional[str]:
        device, resolved = trial_device(cfg)  # a bf16 scan on emulated bf16 is refused here, before anything is written
        return scan_precision(cfg, out_dir, resolved, device)

    def design(self, cfg, out_dir: Path) -> list[dict]:
        """Every trial the scan has planned so far (its grids grow as it runs)."""
        return design_for(load_plan(out_dir), cfg.replicates or DEFAULT_SEEDS, cfg.seed)

    def run(self, cfg, out_dir: Path, design: list[dict], precision, run_design, finished, replay) -> list[dict]:
        return run_scan(cfg, out_dir, cfg.replicates or DEFAULT_SEEDS, precision, run_design, finished, replay)


def study_for(cfg) -> Study:
    """The study a sweep config runs: the scaling study for --grid lr_bs (a scan with --sizes), else the lab's own."""
    if cfg.grid != "lr_bs":
        return Study()
    return ScanStudy() if cfg.sizes else LrStudy()
