"""The sweep report: results.csv, main effects with bootstrap CIs, two-factor interactions, the
"effective gain" verdict, and plots (all loss curves on one figure, main effects)."""
from __future__ import annotations

import csv
import io
import itertools
from pathlib import Path
from typing import Any, Optional

import numpy as np

from llmlab.core.io import atomic_write_text
from llmlab.sweep import metrics as M
from llmlab.sweep.design import FACTORS, design_table

GAIN_DELTA, GAIN_STABILITY, GAIN_SPEEDUP = -0.05, 0.8, 0.9
SCALAR_KEYS = ("final_loss", "final_train_loss", "val_perplexity", "stability_index", "initial_loss_slope",
               "early_loss_std", "attention_entropy_last_layer", "update_ratio_mean", "grad_norm_mean",
               "grad_norm_std", "clipped_steps", "skipped_steps", "peak_memory_mb", "time_per_step_s",
               "wall_time_s", "startup_s", "warmup_steps", "accumulation_steps", "train_tokens")


def flat_row(result: dict) -> dict[str, Any]:
    """One CSV row / one dict for the scaling analysis: hyperparameters, status and scalar metrics."""
    hp = result.get("hparams", {})
    row: dict[str, Any] = {"trial_id": result["trial_id"], "status": result.get("status"),
                           "boundary": result.get("boundary", False), "attempts": result.get("attempts"),
                           "model": result.get("model"), "steps": result.get("steps"), **hp}
    row["fallback"] = result.get("fallback")
    row.update({k: result.get(k) for k in SCALAR_KEYS})
    for segment, loss in (result.get("val_loss_by_position") or {}).items():
        row[f"val_loss_pos_{segment}"] = loss
    for group, ratio in (result.get("update_ratio") or {}).items():
        row[f"update_ratio_{group}"] = ratio
    row["failures"] = " | ".join(result.get("failures") or [])
    row["log_tail"] = result.get("log_tail", "")
    return row


def reference_id(design: list[dict]) -> str:
    ids = [t["trial_id"] for t in design]
    return "control" if "control" in ids else ids[0]


def derived_metrics(design: list[dict], results: list[dict], target_loss: Optional[float]) -> tuple[list[dict], dict]:
    """Rows with delta vs control, steps to target and the effective-gain verdict; plus summary facts."""
    by_id = {r["trial_id"]: r for r in results}
    ref = by_id.get(reference_id(design))
    ref_ok = ref is not None and ref.get("status") == "ok"
    target = target_loss if target_loss is not None else (
        M.default_target(ref["curves"]["loss"]) if ref_ok else None)
    ref_steps = M.steps_to_target(ref["curves"]["loss"], target) if ref_ok and target is not None else None
    rows = []
    for trial in design:
        result = by_id.get(trial["trial_id"])
        if result is None:
            rows.append({"trial_id": trial["trial_id"], "status": "pending", **{k: trial.get(k) for k in FACTORS}})
            continue
        row = flat_row(result)
        ok = result.get("status") == "ok"
        row["steps_to_target"] = (M.steps_to_target(result["curves"]["loss"], target)
                                  if ok and target is not None else None)
        row["delta_loss"] = result["final_loss"] - ref["final_loss"] if ok and ref_ok else None
        row["effective_gain"] = bool(
            ok and ref_ok and row["trial_id"] != ref["trial_id"] and row["delta_loss"] < GAIN_DELTA
            and _lt(row["stability_index"], ref.get("stability_index"), GAIN_STABILITY)
            and row["steps_to_target"] is not None and ref_steps is not None
            and row["steps_to_target"] <= GAIN_SPEEDUP * ref_steps)
        rows.append(row)
    return rows, {"reference": reference_id(design), "reference_ok": ref_ok, "target_loss": target,
                  "reference_steps_to_target": ref_steps}


def _lt(value, ref, factor) -> bool:
    return value is not None and ref is not None and value < factor * ref


def main_effects(rows: list[dict], factors: list[str], metric: str = "final_loss", seed: int = 42) -> list[dict]:
    """Per factor level: mean metric minus the grand mean, with a 95% bootstrap CI (scipy)."""
    from scipy.stats import bootstrap

    ok = [r for r in rows if r.get("status") == "ok" and r.get(metric) is not None]
    if not ok:
        return []
    grand = float(np.mean([r[metric] for r in ok]))
    effects = []
    for factor in factors:
        for level in sorted({r[factor] for r in ok}, key=lambda v: _level_order(factor, v)):
            values = np.array([r[metric] for r in ok if r[factor] == level], dtype=float)
            low = high = None
            if len(values) >= 2 and np.ptp(values) > 0:
                ci = bootstrap((values,), np.mean, n_resamples=2000, confidence_level=0.95, method="percentile",
                               random_state=np.random.default_rng(seed)).confidence_interval
                low, high = float(ci.low) - grand, float(ci.high) - grand
            elif len(values) >= 2:
                low = high = float(values.mean()) - grand
            effects.append({"factor": factor, "level": str(level), "n": len(values),
                            "effect": float(values.mean()) - grand, "ci_low": low, "ci_high": high})
    return effects


def _level_order(factor: str, value) -> tuple:
    """Levels in design order (100 < 500 < 1000; linear, cosine, polynomial), unknown ones after."""
    levels = FACTORS.get(factor, [])
    if value in levels:
        return (0, levels.index(value), "")
    return (1, value if isinstance(value, (int, float)) else 0, str(value))


def interactions(rows: list[dict], factors: list[str], metric: str = "final_loss") -> list[dict]:
    """Two-factor interaction strength: RMS gap between cell means and the additive (main-effects) model."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get(metric) is not None]
    if len(ok) < 4:
        return []
    grand = np.mean([r[metric] for r in ok])
    level_mean = {(f, lv): np.mean([r[metric] for r in ok if r[f] == lv]) for f in factors for lv in {r[f] for r in ok}}
    found = []
    for a, b in itertools.combinations(factors, 2):
        gaps, worst = [], None
        for la, lb in itertools.product({r[a] for r in ok}, {r[b] for r in ok}):
            cell = [r[metric] for r in ok if r[a] == la and r[b] == lb]
            if not cell:
                continue
            gap = float(np.mean(cell) - (level_mean[(a, la)] + level_mean[(b, lb)] - grand))
            gaps.extend([gap] * len(cell))
            if worst is None or abs(gap) > abs(worst[2]):
                worst = (la, lb, gap, len(cell))
        if gaps:
            found.append({"factors": f"{a} x {b}", "strength": float(np.sqrt(np.mean(np.square(gaps)))),
                          "largest_cell": f"{a}={worst[0]}, {b}={worst[1]}: {worst[2]:+.4f} (n={worst[3]})"})
    return sorted(found, key=lambda x: -x["strength"])


def varying_factors(design: list[dict]) -> list[str]:
    names = list(FACTORS) + ["lr", "batch_size"]
    return [n for n in names if len({str(t.get(n)) for t in design if n in t}) > 1]


def write_csv(path: Path, rows: list[dict]) -> None:
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buffer.getvalue())


def plot_loss_curves(path: Path, results: list[dict], reference: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for result in results:
        curve = (result.get("curves") or {}).get("loss")
        if not curve:
            continue
        is_ref = result["trial_id"] == reference
        ax.plot(np.arange(1, len(curve) + 1), M.smooth(curve), lw=2.5 if is_ref else 1, color="black" if is_ref else None,
                alpha=1 if is_ref else 0.7, label=f"{result['trial_id']} ({result.get('status')})")
    ax.set(xlabel="step", ylabel="training loss (moving average of 10)", title="Loss curves of all trials")
    ax.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_main_effects(path: Path, effects: list[dict], factors: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(1, len(factors)), figsize=(3.2 * max(1, len(factors)), 3.6), sharey=True, squeeze=False)
    for ax, factor in zip(axes[0], factors):
        mine = [e for e in effects if e["factor"] == factor]
        x = np.arange(len(mine))
        y = [e["effect"] for e in mine]
        err = np.array([[e["effect"] - e["ci_low"] if e["ci_low"] is not None else 0 for e in mine],
                        [e["ci_high"] - e["effect"] if e["ci_high"] is not None else 0 for e in mine]])
        ax.errorbar(x, y, yerr=err, marker="o", capsize=4)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(x, [str(e["level"]) for e in mine])
        ax.set_title(factor)
    axes[0][0].set_ylabel("final loss - grand mean (95% CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e-3 or abs(value) >= 1e4 else f"{value:.{digits}f}"
    return str(value)


def _table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_report(out_dir: Path, design: list[dict], results: list[dict], cfg) -> dict:
    out_dir = Path(out_dir)
    rows, facts = derived_metrics(design, results, getattr(cfg, "target_loss", None))
    write_csv(out_dir / "results.csv", rows)
    factors = varying_factors(design)
    effects = main_effects(rows, factors, seed=getattr(cfg, "seed", 42))
    pairs = interactions(rows, factors)
    plots = out_dir / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    plot_loss_curves(plots / "loss_curves.png", results, facts["reference"])
    if effects:
        plot_main_effects(plots / "main_effects.png", effects, factors)
    statuses = {s: sum(r["status"] == s for r in rows) for s in sorted({r["status"] for r in rows})}
    gains = [r["trial_id"] for r in rows if r.get("effective_gain")]
    lines = [
        f"# Sweep report: {cfg.grid} ({cfg.budget} budget, model {cfg.model})", "",
        f"{len(rows)} trials: " + ", ".join(f"{n} {s}" for s, n in statuses.items())
        + f". Reference run: `{facts['reference']}`" + ("" if facts["reference_ok"] else " (did not finish ok: no deltas)")
        + f". Target loss for convergence speed: {_fmt(facts['target_loss'])}"
        + f" (reference reaches it at step {_fmt(facts['reference_steps_to_target'])}).", "",
        "## Design", "", design_table(design), "",
        "## Results", "",
        _table(rows, ["trial_id", "status", "boundary", "final_loss", "delta_loss", "val_perplexity",
                      "stability_index", "steps_to_target", "grad_norm_mean", "peak_memory_mb", "time_per_step_s",
                      "effective_gain"]), "",
        "## Main effects on final (validation) loss", "",
        "Level mean minus the grand mean of all ok trials; 95% percentile bootstrap CI (scipy.stats.bootstrap, "
        "2000 resamples). Negative = lower loss.", "",
        _table(effects, ["factor", "level", "n", "effect", "ci_low", "ci_high"]) if effects else "_no finished trials_", "",
        "![main effects](plots/main_effects.png)", "",
        "## Top two-factor interactions", "",
        "RMS gap between cell means and the additive main-effects model (cells are sparse in 20 runs: read as hints).", "",
        _table(pairs[:3], ["factors", "strength", "largest_cell"]) if pairs else "_too few finished trials_", "",
        "## Verdict: effective gain", "",
        f"A run shows an effective gain when delta loss < {GAIN_DELTA} AND stability index < {GAIN_STABILITY} x the "
        f"reference's AND it reaches the target loss in <= {GAIN_SPEEDUP} x the reference's steps (>= 10% faster).", "",
        ("**Effective gain:** " + ", ".join(f"`{g}`" for g in gains)) if gains else
        "**No run shows an effective gain** over the reference under these criteria.", "",
        "## Loss curves", "", "![loss curves](plots/loss_curves.png)", "",
    ]
    problems = [r for r in rows if r["status"] not in ("ok", "pending") or r.get("boundary")]
    if problems:
        lines += ["## Failed, crashed and boundary trials", ""]
        for row in problems:
            lines.append(f"- `{row['trial_id']}` {row['status']}" + (" (boundary case)" if row.get("boundary") else "")
                         + f": {row.get('failures') or '-'}" + (f"; retried with {row['fallback']}" if row.get("fallback") else ""))
            if row.get("log_tail"):
                lines += ["", "```", row["log_tail"], "```", ""]
    lines += ["", f"TensorBoard (curves and HParams tab): `tensorboard --logdir {out_dir / 'trials'}`", ""]
    atomic_write_text(out_dir / "report.md", "\n".join(lines))
    return {"rows": rows, "effects": effects, "interactions": pairs, "facts": facts, "gains": gains}
