"""The sweep report: the noise floor first, then results.csv, least-squares main effects judged against that
noise, a sensitivity map (which knob moves which outcome), interaction hints, the effective-gain verdict, plots."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np
from scipy import stats as sps

from llmlab.core.io import atomic_write_json, atomic_write_text
from llmlab.sweep import metrics as M
from llmlab.sweep import stats
from llmlab.sweep.design import FACTORS, design_table, reference_id
from llmlab.sweep.factors import EXTRA_FACTORS
from llmlab.sweep.metrics import reference_lines
from llmlab.train.components import OPTIMIZERS, mean_lr_share

GAIN_DELTA, GAIN_STABILITY, GAIN_SPEEDUP = -0.05, 0.8, 0.9
SCALAR_KEYS = (
    "initial_loss",
    "final_loss",
    "final_train_loss",
    "val_perplexity",
    "stability_index",
    "initial_loss_slope",
    "early_loss_std",
    "attention_entropy_last_layer",
    "update_ratio_mean",
    "grad_param_ratio_mean",
    "grad_norm_mean",
    "grad_norm_std",
    "clipped_steps",
    "skipped_steps",
    "peak_memory_mb",
    "time_per_step_s",
    "tokens_per_s",
    "wall_time_s",
    "startup_s",
    "warmup_steps",
    "accumulation_steps",
    "train_tokens",
    "n_params",
    "n_params_total",
    "compute_flops",
    "precision",
    "compiled",
    "memory_source",
    "model_width",
    "model_depth",
    "seq_len",
    "micro_batch_size",
)
CALIBRATED = {
    "final_loss": "final (validation) loss, nats",
    "stability_index": "stability index",
    "steps_to_target": "steps to target loss",
    "attention_entropy_last_layer": "attention entropy, nats",
}
SENSITIVITY_OUTCOMES = (
    "final_loss",
    "stability_index",
    "steps_to_target",
    "attention_entropy_last_layer",
    "grad_norm_mean",
    "grad_norm_std",
    "peak_memory_mb",
)


def flat_row(result: dict) -> dict[str, Any]:
    """One CSV row / one dict for the scaling analysis: hyperparameters, seed, status and scalar metrics."""
    hp = result.get("hparams", {})
    row: dict[str, Any] = {
        "trial_id": result["trial_id"],
        "status": result.get("status"),
        "seed": result.get("seed"),
        "replicate": result.get("replicate", 0),
        "boundary": result.get("boundary", False),
        "attempts": result.get("attempts"),
        "model": result.get("model"),
        "steps": result.get("steps"),
        "node": result.get("node"),
        "cpu": result.get("cpu"),
        **hp,
    }
    row["fallback"] = result.get("fallback")
    row.update({k: result.get(k) for k in SCALAR_KEYS})
    for segment, loss in (result.get("val_loss_by_position") or {}).items():
        row[f"val_loss_pos_{segment}"] = loss
    for group, ratio in (result.get("update_ratio") or {}).items():
        row[f"update_ratio_{group}"] = ratio
    for group, ratio in (result.get("grad_param_ratio") or {}).items():
        row[f"grad_param_ratio_{group}"] = ratio
    row["failures"] = " | ".join(result.get("failures") or [])
    row["log_tail"] = result.get("log_tail", "")
    return row


def _mean(values) -> Optional[float]:
    values = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return float(np.mean(values)) if values else None


def _reference_runs(design: list[dict], by_id: dict) -> tuple[str, list[dict]]:
    point_of = {t["trial_id"]: t.get("point", t["trial_id"]) for t in design}
    ref_point = point_of[reference_id(design)]
    runs = [by_id[t] for t, p in point_of.items() if p == ref_point and by_id.get(t, {}).get("status") == "ok"]
    return ref_point, runs


def derived_metrics(design: list[dict], results: list[dict], target_loss: Optional[float]) -> tuple[list[dict], dict]:
    """Rows with steps to target, delta vs the reference (mean of its replicates) with a 95 % CI from the seed
    noise, and the effective-gain verdict per design point; plus summary facts."""
    by_id = {r["trial_id"]: r for r in results}
    ref_point, ref_runs = _reference_runs(design, by_id)
    target = target_loss
    if target is None and ref_runs:
        target = M.default_target(list(np.mean([r["curves"]["loss"] for r in ref_runs], axis=0)))
    rows = []
    for trial in design:
        result = by_id.get(trial["trial_id"])
        if result is None:
            rows.append(
                {
                    "trial_id": trial["trial_id"],
                    "status": "pending",
                    "point": trial.get("point"),
                    **{k: trial.get(k) for k in FACTORS},
                }
            )
            continue
        row = {**flat_row(result), "point": trial.get("point", trial["trial_id"])}
        ok = result.get("status") == "ok"
        row["steps_to_target"] = (
            M.steps_to_target(result["curves"]["loss"], target) if ok and target is not None else None
        )
        rows.append(row)
    reference = {
        "final_loss": [r["final_loss"] for r in ref_runs],
        "stability_index": _mean(r.get("stability_index") for r in ref_runs),
        "steps_to_target": _mean(
            r["steps_to_target"] for r in rows if r["point"] == ref_point and r.get("status") == "ok"
        ),
    }
    noise = stats.pure_error(rows, "final_loss")
    _judge_points(rows, ref_point, reference, noise)
    return rows, {
        "reference": ref_point,
        "reference_ok": bool(ref_runs),
        "reference_runs": len(ref_runs),
        "target_loss": target,
        "reference_steps_to_target": reference["steps_to_target"],
        "noise": noise,
    }


def _judge_points(rows: list[dict], ref_point: str, reference: dict, noise: dict) -> None:
    """Delta vs the reference per design point (95 % CI from the seed noise), Holm across the points, and the
    effective-gain verdict, written into every replicate row of each point."""
    judged = {}
    for point in dict.fromkeys(r["point"] for r in rows):
        ok = [r for r in rows if r["point"] == point and r.get("status") == "ok"]
        if ok and reference["final_loss"]:
            judged[point] = (
                ok,
                stats.compare_to_reference(
                    [r["final_loss"] for r in ok], reference["final_loss"], noise["sd"], noise["df"]
                ),
            )
    tested = [p for p, (_, c) in judged.items() if p != ref_point and c["p_value"] is not None]
    adjusted = dict(zip(tested, stats.holm([judged[p][1]["p_value"] for p in tested])))
    for point in dict.fromkeys(r["point"] for r in rows):
        verdict: dict[str, Any] = {
            "delta_loss": None,
            "delta_ci_low": None,
            "delta_ci_high": None,
            "delta_p_holm": None,
            "gain_resolved": False,
            "effective_gain": False,
        }
        if point in judged:
            ok, compared = judged[point]
            resolved = adjusted.get(point, 1.0) < stats.ALPHA
            stability, steps = _mean(r.get("stability_index") for r in ok), _mean(r["steps_to_target"] for r in ok)
            gain = (
                resolved
                and compared["delta"] < GAIN_DELTA
                and _lt(stability, reference["stability_index"], GAIN_STABILITY)
                and steps is not None
                and reference["steps_to_target"] is not None
                and steps <= GAIN_SPEEDUP * reference["steps_to_target"]
            )
            verdict = {
                "delta_loss": compared["delta"],
                "delta_ci_low": compared["ci_low"],
                "delta_ci_high": compared["ci_high"],
                "delta_p_holm": adjusted.get(point),
                "gain_resolved": resolved,
                "effective_gain": bool(gain),
            }
        for row in (r for r in rows if r["point"] == point):
            row.update(verdict)


def _lt(value, ref, factor) -> bool:
    return value is not None and ref is not None and value < factor * ref


def level_order() -> dict[str, list]:
    return {name: list(levels) for name, levels in FACTORS.items()}


def reference_levels(design: list[dict]) -> dict[str, str]:
    """The named reference of every effect: the levels of the reference trial (doe20: the control)."""
    ref = next(t for t in design if t["trial_id"] == reference_id(design))
    return {k: str(v) for k, v in ref.items() if k in FACTORS or k in EXTRA_FACTORS}


def effects(rows: list[dict], design: list[dict], metric: str = "final_loss") -> dict:
    """Treatment contrasts of every varying factor against the reference trial's levels (llmlab.sweep.stats)."""
    return stats.fit_effects(rows, varying_factors(design), reference_levels(design), metric, level_order())


def varying_factors(design: list[dict]) -> list[str]:
    names = list(FACTORS) + list(EXTRA_FACTORS)
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


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss_curves(path: Path, results: list[dict], reference: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for result in results:
        curve = (result.get("curves") or {}).get("loss")
        if not curve:
            continue
        is_ref = result["trial_id"] == reference
        ax.plot(
            np.arange(1, len(curve) + 1),
            M.smooth(curve),
            lw=2.5 if is_ref else 1,
            color="black" if is_ref else None,
            alpha=1 if is_ref else 0.7,
            label=f"{result['trial_id']} ({result.get('status')})",
        )
    ax.set(xlabel="step", ylabel="training loss (moving average of 10)", title="Loss curves of all trials")
    ax.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_main_effects(path: Path, effects: list[dict], factors: list[str]) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(
        1, max(1, len(factors)), figsize=(3.2 * max(1, len(factors)), 3.6), sharey=True, squeeze=False
    )
    for ax, factor in zip(axes[0], factors):
        mine = [e for e in effects if e["factor"] == factor]
        x = np.arange(len(mine))
        y = [e["effect"] for e in mine]
        err = np.array(
            [
                [e["effect"] - e["ci_low"] if e["ci_low"] is not None else 0 for e in mine],
                [e["ci_high"] - e["effect"] if e["ci_high"] is not None else 0 for e in mine],
            ]
        )
        ax.errorbar(x, y, yerr=err, fmt="none", ecolor="grey", capsize=4)
        colours = ["C3" if e["verdict"] == "resolved" else "C0" for e in mine]
        ax.scatter(x, y, c=colours, zorder=3)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(x, [str(e["level"]) for e in mine])
        ax.set_title(f"{factor} (vs {mine[0]['reference']})" if mine else factor, fontsize=9)
    axes[0][0].set_ylabel("level - reference, final loss (95% CI)\nred: resolved (Holm), blue: within noise")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sensitivity(path: Path, shares: dict[str, dict[str, float]], factors: list[str]) -> None:
    plt = _pyplot()
    outcomes = list(shares)
    columns = factors + ["residual"]
    grid = np.array([[shares[o].get(c, 0.0) for c in columns] for o in outcomes])
    fig, ax = plt.subplots(figsize=(1.3 * len(columns) + 3, 0.6 * len(outcomes) + 1.6))
    image = ax.imshow(grid, cmap="viridis", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(columns)), columns, rotation=30, ha="right")
    ax.set_yticks(range(len(outcomes)), outcomes)
    for (i, j), value in np.ndenumerate(grid):
        ax.text(
            j, i, f"{100 * value:.0f}%", ha="center", va="center", color="white" if value < 0.6 else "black", fontsize=8
        )
    fig.colorbar(image, ax=ax, label="share of variance (type II sums of squares)")
    ax.set_title("Which knob moves which outcome")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cell(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}g}" if abs(value) < 1e-3 or abs(value) >= 1e4 else f"{value:.{digits}f}"
    return str(value)


def _table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _ci(low, high, digits: int = 3) -> str:
    return "-" if low is None else f"[{low:.{digits}f}, {high:.{digits}f}]"


def calibration_section(rows: list[dict], facts: dict, fitted: dict) -> list[str]:
    """The noise floor, before any reading: seed SD of each outcome, and what effects this design can detect."""
    lines = ["## Calibration: the noise floor", ""]
    noise = facts["noise"]
    if noise["sd"] is None:
        return lines + [
            "**No seed replicates: this report cannot tell an effect from seed noise.** Every effect "
            "below is judged against the fit's residual at best. Rerun with `--replicates 6` (resume "
            "keeps the finished trials and runs only the new seeds).",
            "",
        ]
    lines += [
        "Seed replicates rerun one configuration with other seeds (model init and data order; the data "
        "split is fixed). Their spread is the noise every effect below is judged against.",
        "",
        "| outcome | replicate groups | replicated runs | mean (reference) | seed SD | 95% CI of SD | df |",
        "|---|---|---|---|---|---|---|",
    ]
    for metric, label in CALIBRATED.items():
        floor = stats.pure_error(rows, metric)
        ref = _mean(r.get(metric) for r in rows if r.get("point") == facts["reference"] and r.get("status") == "ok")
        lines.append(
            f"| {label} | {floor['groups']} | {floor['runs']} | {cell(ref)} | {cell(floor['sd'])} | "
            f"{_ci(*floor['ci'], digits=4)} | {floor['df']} |"
        )
    k = facts["reference_runs"]
    single = sps_t(noise["df"]) * noise["sd"] * math.sqrt(1 + 1 / max(k, 1))
    needed = stats.replicates_needed(noise["sd"], noise["df"])
    worst = stats.replicates_needed(noise["ci"][1], noise["df"])
    mde = stats.minimum_detectable_effect(fitted) if fitted.get("contrasts") else None
    error = fitted.get("noise") or {}
    lines += [
        "",
        f"- **Smallest difference one run can show against the reference ({k} runs) at 95 %:** "
        f"{single:.3f} nats of final loss (t with {noise['df']} df x seed SD x sqrt(1 + 1/{k})).",
        f"- **Smallest level contrast this design detects with 80 % power** (5 %, two-sided, before the Holm "
        f"correction; median over the contrasts, t on the residual's {error.get('df', '-')} df): {cell(mde)} nats.",
        f"- **Runs per configuration to detect {stats.TARGET_EFFECT} nats** (two configurations, 5 % two-sided, "
        f"80 % power, t with the SD's {noise['df']} df): {needed} at the measured seed SD, {worst} at the upper "
        f"end of its 95 % interval.",
        "",
    ]
    return lines


def sps_t(df: int) -> float:
    return float(sps.t.ppf(0.975, df))


def effects_section(fitted: dict, plots: Path) -> list[str]:
    lines = ["## Effects on final loss: contrasts against the reference", ""]
    if not fitted["contrasts"]:
        return lines + [f"_not estimable: {fitted['n']} finished trials for {fitted['params']} parameters_", ""]
    noise = fitted["noise"]
    plot_main_effects(plots / "main_effects.png", fitted["contrasts"], fitted["factors"])
    table = [
        {**c, "contrast": f"{c['level']} - {c['reference']}", "95% CI": _ci(c["ci_low"], c["ci_high"])}
        for c in fitted["contrasts"]
    ]
    tests = stats.factor_tests(fitted)
    lof = fitted.get("lack_of_fit")
    pure = noise["pure_error"]
    lines += [
        "Each effect is a level minus the factor's reference level (the reference trial's: "
        + ", ".join(f"{f} = {v}" for f, v in fitted["reference"].items())
        + f"), all fitted jointly by least squares (statsmodels OLS, treatment coding) on {fitted['n']} finished runs: "
        f"a Latin hypercube is not orthogonal, so marginal level means would mix the factors. Error term: "
        f"{noise['source']}, SD {cell(noise['sd'])} on {noise['df']} df"
        + (f"; the replicates' pure error alone is {cell(pure['sd'])} on {pure['df']} df" if pure["sd"] else "")
        + (
            f" (lack of fit F = {lof['F']:.2f} on {lof['df'][0]}, {lof['df'][1]} df, p = {lof['p_value']:.3g})"
            if lof
            else ""
        )
        + ". 95 % CIs are per contrast; `resolved` = Holm-adjusted p < 0.05 across all "
        f"{len(table)} contrasts (one family).",
        "",
        _table(table, ["factor", "contrast", "n", "effect", "95% CI", "p_value", "p_holm", "verdict"]),
        "",
    ]
    if tests:
        lines += [
            "Does each factor matter at all? F test of its type II sum of squares against the same error term, "
            "Holm across the factors: "
            + "; ".join(
                f"**{t['factor']}** F = {t['F']:.2f} ({t['df']}, "
                f"{noise['df']} df), p = {t['p_value']:.3g}, Holm "
                f"{t['p_holm']:.3g} ({t['verdict']})"
                for t in tests
            )
            + ".",
            "",
        ]
    return lines + [*caveats(fitted), "![main effects](plots/main_effects.png)", ""]


def caveats(fitted: dict) -> list[str]:
    """What a contrast also carries: the optimizer's own step size and each schedule's mean lr (computed)."""
    notes = []
    levels = [OPTIMIZERS[name] for name in fitted["levels"].get("optimizer", []) if name in OPTIMIZERS]
    scaled = [entry for entry in levels if entry.lr_divisor != 1.0]
    if "optimizer" in fitted["factors"] and scaled:
        plain = " and ".join(entry.label for entry in levels if entry.lr_divisor == 1.0)
        notes += [
            f"- **optimizer is confounded with step size:** {entry.label} runs at lr / {entry.lr_divisor:g} with "
            f"weight decay x {entry.lr_divisor:g} (its authors' advice), {plain} at the lr itself, so the "
            f"{entry.label} contrast is {entry.label}-at-that-step-size, not {entry.label} at its own best lr."
            for entry in scaled
        ]
    if "scheduler" in fitted["factors"]:
        shares = {name: mean_lr_share(name) for name in fitted["levels"]["scheduler"]}
        notes.append(
            "- **scheduler is confounded with the mean lr:** over a run (warmup excluded) the schedules "
            "average "
            + ", ".join(f"{name} {share:.2f}" for name, share in shares.items())
            + " of the peak lr, so part of a scheduler contrast is an lr effect."
        )
    return ["Caveats:", "", *notes, ""] if notes else []


def sensitivity_section(rows: list[dict], design: list[dict], plots: Path) -> list[str]:
    factors = varying_factors(design)
    shares = stats.variance_shares(rows, factors, list(SENSITIVITY_OUTCOMES), reference_levels(design), level_order())
    lines = ["## Sensitivity map: which knob moves which outcome", ""]
    if not shares:
        return lines + ["_too few finished trials to split the variance_", ""]
    plot_sensitivity(plots / "sensitivity.png", shares, [f for f in factors if any(f in s for s in shares.values())])
    columns = [f for f in factors if any(f in s for s in shares.values())] + ["residual", "shared"]
    table = [{"outcome": o, **{c: f"{100 * s.get(c, 0.0):.0f}%" for c in columns}} for o, s in shares.items()]
    return lines + [
        "Each factor's type II sum of squares as a share of the outcome's **total** sum of squares; "
        "`residual` is what the main effects leave (interactions and noise); `shared` is the rest: in a "
        "non-orthogonal design part of the variance belongs to no factor alone.",
        "",
        _table(table, ["outcome"] + columns),
        "",
        "![sensitivity](plots/sensitivity.png)",
        "",
    ]


def verdict_section(rows: list[dict], facts: dict) -> list[str]:
    gains = list(dict.fromkeys(r["point"] for r in rows if r.get("effective_gain")))
    points = {}
    for row in rows:
        if row.get("delta_loss") is not None and row["point"] != facts["reference"]:
            points.setdefault(row["point"], row)
    table = [
        {
            "point": p,
            "delta_loss": r["delta_loss"],
            "95% CI": _ci(r["delta_ci_low"], r["delta_ci_high"]),
            "p_holm": r.get("delta_p_holm"),
            "resolved": r["gain_resolved"],
            "effective_gain": r["effective_gain"],
        }
        for p, r in points.items()
    ]
    lines = [
        "## Verdict: effective gain",
        "",
        f"A design point shows an effective gain when its final loss is below the reference's by more than "
        f"{-GAIN_DELTA} nats AND that difference is resolved (t test against the seed noise, Holm-adjusted p < "
        f"0.05 across the {len(table)} points) AND its stability index is < {GAIN_STABILITY} x the reference's "
        f"AND it reaches the target loss in <= {GAIN_SPEEDUP} x the reference's steps.",
        "",
    ]
    if facts["noise"]["sd"] is None:
        lines += ["_No seed replicates, so no difference can be resolved: no verdict is possible._", ""]
    if table:
        lines += [_table(table, ["point", "delta_loss", "95% CI", "p_holm", "resolved", "effective_gain"]), ""]
    lines += [
        ("**Effective gain:** " + ", ".join(f"`{g}`" for g in gains))
        if gains
        else "**No design point shows an effective gain** over the reference under these criteria.",
        "",
    ]
    return lines


def interactions_section(fitted: dict) -> list[str]:
    pairs = stats.interaction_tests(fitted)
    lines = [
        "## Two-factor interactions",
        "",
        "Every pair, one family: each pair's extra sum of squares over the main-effects model (a screening design "
        "cannot hold every pair's df at once), F against the replicates' pure error, Holm across the pairs.",
        "",
    ]
    table = [{**p, "df": f"{p['df'][0]}, {p['df'][1]}"} for p in pairs]
    return lines + [
        _table(table, ["factors", "df", "F", "p_value", "p_holm", "verdict"])
        if pairs
        else "_no pure error (replicates) or too few runs to test any_",
        "",
    ]


def write_report(out_dir: Path, design: list[dict], results: list[dict], cfg) -> dict:
    # long: a Markdown template, section by section in the order the page reads
    out_dir = Path(out_dir)
    rows, facts = derived_metrics(design, results, getattr(cfg, "target_loss", None))
    write_csv(out_dir / "results.csv", rows)
    plots = out_dir / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    plot_loss_curves(plots / "loss_curves.png", results, reference_id(design))
    fitted = effects(rows, design)
    statuses = {s: sum(r["status"] == s for r in rows) for s in sorted({r["status"] for r in rows})}
    lines = [
        f"# Sweep report: {cfg.grid} ({cfg.budget} budget, model {cfg.model})",
        "",
        f"{len(rows)} runs: "
        + ", ".join(f"{n} {s}" for s, n in statuses.items())
        + f". Reference: `{facts['reference']}` ({facts['reference_runs']} finished run(s))"
        + ("" if facts["reference_ok"] else " (did not finish ok: no deltas)")
        + f". Target loss for convergence speed: {cell(facts['target_loss'])}"
        + f" (the reference reaches it at step {cell(facts['reference_steps_to_target'])} on average).",
        "",
        *_reference_lines(out_dir, cfg),
        *calibration_section(rows, facts, fitted),
        "## Design",
        "",
        design_table(design),
        "",
        "## Results",
        "",
        _table(
            rows,
            [
                "trial_id",
                "seed",
                "status",
                "boundary",
                "final_loss",
                "delta_loss",
                "val_perplexity",
                "stability_index",
                "steps_to_target",
                "grad_norm_mean",
                "peak_memory_mb",
                "time_per_step_s",
                "effective_gain",
            ],
        ),
        "",
        *effects_section(fitted, plots),
        *sensitivity_section(rows, design, plots),
        *interactions_section(fitted),
        *verdict_section(rows, facts),
        "## Loss curves",
        "",
        "![loss curves](plots/loss_curves.png)",
        "",
    ]
    lines += _problems_section(rows)
    lines += ["", f"TensorBoard (curves and HParams tab): `tensorboard --logdir {out_dir / 'trials'}`", ""]
    atomic_write_text(out_dir / "report.md", "\n".join(lines))
    return {
        "rows": rows,
        "effects": fitted["contrasts"],
        "facts": facts,
        "gains": list(dict.fromkeys(r["point"] for r in rows if r.get("effective_gain"))),
    }


def _reference_lines(out_dir: Path, cfg) -> list[str]:
    budget = cfg.budget_spec
    ref = reference_lines(out_dir / "data", budget.eval_batches * budget.batch_size)
    if not ref or ref["unigram"] is None:
        return []
    atomic_write_json(out_dir / "reference_lines.json", ref)  # a shipped folder keeps them without its data/
    return [
        f"Reference lines on the {ref['eval_tokens']:,} validation tokens every trial is scored on: uniform "
        f"guess {ref['uniform']:.2f} nats, add-one unigram model of the training split {ref['unigram']:.2f} "
        "nats. A final loss below the unigram line means the model uses context.",
        "",
    ]


def _problems_section(rows: list[dict]) -> list[str]:
    problems = [r for r in rows if r["status"] not in ("ok", "pending") or r.get("boundary")]
    if not problems:
        return []
    lines = ["## Failed, crashed and boundary trials", ""]
    for row in problems:
        lines.append(
            f"- `{row['trial_id']}` {row['status']}"
            + (" (boundary case)" if row.get("boundary") else "")
            + f": {row.get('failures') or '-'}"
            + (f"; retried with {row['fallback']}" if row.get("fallback") else "")
        )
        if row.get("log_tail"):
            lines += ["", "```", row["log_tail"], "```", ""]
    return lines
