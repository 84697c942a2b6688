"""The sweep report: the noise floor first, then results.csv, least-squares main effects judged against that
noise, a sensitivity map (which knob moves which outcome), interaction hints, the effective-gain verdict, plots."""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np

from llmlab.core.io import atomic_write_text
from llmlab.sweep import metrics as M
from llmlab.sweep import stats
from llmlab.sweep.design import EXTRA_FACTORS, FACTORS, design_table, reference_id

GAIN_DELTA, GAIN_STABILITY, GAIN_SPEEDUP = -0.05, 0.8, 0.9
SCALAR_KEYS = ("final_loss", "final_train_loss", "val_perplexity", "stability_index", "initial_loss_slope",
               "early_loss_std", "attention_entropy_last_layer", "update_ratio_mean", "grad_norm_mean",
               "grad_norm_std", "clipped_steps", "skipped_steps", "peak_memory_mb", "time_per_step_s",
               "tokens_per_s", "wall_time_s", "startup_s", "warmup_steps", "accumulation_steps", "train_tokens",
               "n_params", "n_params_total", "compute_flops", "precision", "compiled")
CALIBRATED = {"final_loss": "final (validation) loss, nats", "stability_index": "stability index",
              "steps_to_target": "steps to target loss", "attention_entropy_last_layer": "attention entropy, nats"}
SENSITIVITY_OUTCOMES = ("final_loss", "stability_index", "steps_to_target", "attention_entropy_last_layer",
                        "grad_norm_mean", "grad_norm_std", "peak_memory_mb")


def flat_row(result: dict) -> dict[str, Any]:
    """One CSV row / one dict for the scaling analysis: hyperparameters, seed, status and scalar metrics."""
    hp = result.get("hparams", {})
    row: dict[str, Any] = {"trial_id": result["trial_id"], "status": result.get("status"),
                           "seed": result.get("seed"), "replicate": result.get("replicate", 0),
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
            rows.append({"trial_id": trial["trial_id"], "status": "pending", "point": trial.get("point"),
                         **{k: trial.get(k) for k in FACTORS}})
            continue
        row = {**flat_row(result), "point": trial.get("point", trial["trial_id"])}
        ok = result.get("status") == "ok"
        row["steps_to_target"] = (M.steps_to_target(result["curves"]["loss"], target)
                                  if ok and target is not None else None)
        rows.append(row)
    reference = {"final_loss": [r["final_loss"] for r in ref_runs],
                 "stability_index": _mean(r.get("stability_index") for r in ref_runs),
                 "steps_to_target": _mean(r["steps_to_target"] for r in rows
                                          if r["point"] == ref_point and r.get("status") == "ok")}
    noise = stats.pure_error(rows, "final_loss")
    for point in dict.fromkeys(r["point"] for r in rows):
        _judge_point([r for r in rows if r["point"] == point], point == ref_point, reference, noise)
    return rows, {"reference": ref_point, "reference_ok": bool(ref_runs), "reference_runs": len(ref_runs),
                  "target_loss": target, "reference_steps_to_target": reference["steps_to_target"], "noise": noise}


def _judge_point(runs: list[dict], is_reference: bool, reference: dict, noise: dict) -> None:
    """Delta vs the reference and the effective-gain verdict, written into every replicate row of one point."""
    ok = [r for r in runs if r.get("status") == "ok"]
    verdict: dict[str, Any] = {"delta_loss": None, "delta_ci_low": None, "delta_ci_high": None,
                               "gain_resolved": False, "effective_gain": False}
    if ok and reference["final_loss"]:
        compared = stats.compare_to_reference([r["final_loss"] for r in ok], reference["final_loss"],
                                              noise["sd"], noise["df"])
        stability, steps = _mean(r.get("stability_index") for r in ok), _mean(r["steps_to_target"] for r in ok)
        gain = (not is_reference and compared["resolved"] and compared["delta"] < GAIN_DELTA
                and _lt(stability, reference["stability_index"], GAIN_STABILITY)
                and steps is not None and reference["steps_to_target"] is not None
                and steps <= GAIN_SPEEDUP * reference["steps_to_target"])
        verdict = {"delta_loss": compared["delta"], "delta_ci_low": compared["ci_low"],
                   "delta_ci_high": compared["ci_high"], "gain_resolved": compared["resolved"] and not is_reference,
                   "effective_gain": bool(gain)}
    for row in runs:
        row.update(verdict)


def _lt(value, ref, factor) -> bool:
    return value is not None and ref is not None and value < factor * ref


def level_order() -> dict[str, list]:
    return {name: list(levels) for name, levels in FACTORS.items()}


def main_effects(rows: list[dict], factors: list[str], metric: str = "final_loss") -> list[dict]:
    """Per factor level: its least-squares effect (deviation from the grand mean) with a 95 % CI and a verdict."""
    return stats.fit_main_effects(rows, factors, metric, level_order())["effects"]


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
        ax.plot(np.arange(1, len(curve) + 1), M.smooth(curve), lw=2.5 if is_ref else 1, color="black" if is_ref else None,
                alpha=1 if is_ref else 0.7, label=f"{result['trial_id']} ({result.get('status')})")
    ax.set(xlabel="step", ylabel="training loss (moving average of 10)", title="Loss curves of all trials")
    ax.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_main_effects(path: Path, effects: list[dict], factors: list[str]) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, max(1, len(factors)), figsize=(3.2 * max(1, len(factors)), 3.6), sharey=True, squeeze=False)
    for ax, factor in zip(axes[0], factors):
        mine = [e for e in effects if e["factor"] == factor]
        x = np.arange(len(mine))
        y = [e["effect"] for e in mine]
        err = np.array([[e["effect"] - e["ci_low"] if e["ci_low"] is not None else 0 for e in mine],
                        [e["ci_high"] - e["effect"] if e["ci_high"] is not None else 0 for e in mine]])
        ax.errorbar(x, y, yerr=err, fmt="none", ecolor="grey", capsize=4)
        colours = ["C3" if e["verdict"] == "resolved" else "C0" for e in mine]
        ax.scatter(x, y, c=colours, zorder=3)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(x, [str(e["level"]) for e in mine])
        ax.set_title(factor)
    axes[0][0].set_ylabel("effect on final loss (95% CI)\nred: resolved, blue: within noise")
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
        ax.text(j, i, f"{100 * value:.0f}%", ha="center", va="center", color="white" if value < 0.6 else "black",
                fontsize=8)
    fig.colorbar(image, ax=ax, label="share of variance (type II sums of squares)")
    ax.set_title("Which knob moves which outcome")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}g}" if abs(value) < 1e-3 or abs(value) >= 1e4 else f"{value:.{digits}f}"
    return str(value)


def _table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _ci(low, high, digits: int = 3) -> str:
    return "-" if low is None else f"[{low:.{digits}f}, {high:.{digits}f}]"


def calibration_section(rows: list[dict], facts: dict, fitted: dict) -> list[str]:
    """The noise floor, before any reading: seed SD of each outcome, and what effects this design can resolve."""
    from scipy import stats as sps

    lines = ["## Calibration: the noise floor", ""]
    noise = facts["noise"]
    if noise["sd"] is None:
        return lines + ["**No seed replicates: this report cannot tell an effect from seed noise.** Every effect "
                        "below is judged against the fit's residual at best. Rerun with `--replicates 3` (resume "
                        "keeps the finished trials and runs only the new seeds).", ""]
    lines += ["Seed replicates rerun one configuration with other seeds (model init and data order; the data "
              "split is fixed). Their spread is the noise every effect below is judged against.", "",
              "| outcome | replicate groups | replicated runs | mean (reference) | seed SD | 95% CI of SD | df |",
              "|---|---|---|---|---|---|---|"]
    for metric, label in CALIBRATED.items():
        floor = stats.pure_error(rows, metric)
        ref = _mean(r.get(metric) for r in rows if r.get("point") == facts["reference"] and r.get("status") == "ok")
        lines.append(f"| {label} | {floor['groups']} | {floor['runs']} | {_fmt(ref)} | {_fmt(floor['sd'])} | "
                     f"{_ci(*floor['ci'], digits=4)} | {floor['df']} |")
    k = facts["reference_runs"]
    single = sps.t.ppf(0.975, noise["df"]) * noise["sd"] * math.sqrt(1 + 1 / max(k, 1))
    needed, worst = stats.replicates_needed(noise["sd"]), stats.replicates_needed(noise["ci"][1])
    lines += ["", f"- **Smallest difference one run can show against the reference ({k} runs) at 95 %:** "
              f"{single:.3f} nats of final loss (t with {noise['df']} df x seed SD x sqrt(1 + 1/{k})).",
              f"- **Smallest main effect this design resolves at 95 %** (median CI half-width of the least-squares "
              f"level effects): {_fmt(stats.minimum_resolvable_effect(fitted))} nats.",
              f"- **Runs per configuration to resolve {stats.TARGET_EFFECT} nats** (two configurations, 95 % "
              f"confidence, 80 % power): {needed} at the measured seed SD, {worst} at the upper end of its 95 % "
              f"interval ({noise['df']} df: more replicates narrow that interval).", ""]
    return lines


def effects_section(fitted: dict, factors: list[str], plots: Path) -> list[str]:
    lines = ["## Main effects on final loss (least squares)", ""]
    if not fitted["effects"]:
        return lines + [f"_not estimable: {fitted['n']} finished trials for {fitted['params']} parameters_", ""]
    noise = fitted["noise"]
    plot_main_effects(plots / "main_effects.png", fitted["effects"], fitted["factors"])
    rows = [{**e, "95% CI": _ci(e["ci_low"], e["ci_high"])} for e in fitted["effects"]]
    tests = stats.factor_tests(fitted)
    per_factor = (["Does each factor matter at all? F test of its levels against the noise (type II sums of "
                   "squares): " + "; ".join(f"**{f['factor']}** p = {f['p_value']:.3g} ({f['verdict']})"
                                              for f in tests) + ".", ""] if tests else [])
    return lines + [
        f"All factors fitted jointly by ordinary least squares (statsmodels; sum-to-zero contrasts, so each level's "
        f"effect is its deviation from the grand mean) on {fitted['n']} finished runs. A Latin hypercube is not "
        f"orthogonal: marginal level means would mix the factors. Noise: {noise['source']}, SD "
        f"{_fmt(noise['sd'])} with {noise['df']} df. `resolved` = the 95 % CI excludes 0.", "",
        _table(rows, ["factor", "level", "n", "effect", "95% CI", "verdict"]), "", *per_factor,
        "![main effects](plots/main_effects.png)", ""]


def sensitivity_section(rows: list[dict], factors: list[str], plots: Path) -> list[str]:
    shares = stats.variance_shares(rows, factors, list(SENSITIVITY_OUTCOMES), level_order())
    lines = ["## Sensitivity map: which knob moves which outcome", ""]
    if not shares:
        return lines + ["_too few finished trials to split the variance_", ""]
    plot_sensitivity(plots / "sensitivity.png", shares, [f for f in factors if any(f in s for s in shares.values())])
    columns = [f for f in factors if any(f in s for s in shares.values())] + ["residual"]
    table = [{"outcome": o, **{c: f"{100 * s.get(c, 0.0):.0f}%" for c in columns}} for o, s in shares.items()]
    return lines + ["Each factor's share of the outcome's variance across the design (type II sums of squares of "
                    "the main-effects fit; `residual` is what the main effects leave: interactions and noise).", "",
                    _table(table, ["outcome"] + columns), "", "![sensitivity](plots/sensitivity.png)", ""]


def verdict_section(rows: list[dict], facts: dict) -> list[str]:
    gains = list(dict.fromkeys(r["point"] for r in rows if r.get("effective_gain")))
    points = {}
    for row in rows:
        if row.get("delta_loss") is not None and row["point"] != facts["reference"]:
            points.setdefault(row["point"], row)
    table = [{"point": p, "delta_loss": r["delta_loss"], "95% CI": _ci(r["delta_ci_low"], r["delta_ci_high"]),
              "resolved": r["gain_resolved"], "effective_gain": r["effective_gain"]} for p, r in points.items()]
    lines = ["## Verdict: effective gain", "",
             f"A design point shows an effective gain when its final loss is below the reference's by more than "
             f"{-GAIN_DELTA} nats AND that difference is resolved (its 95 % CI from the seed noise excludes 0) AND its "
             f"stability index is < {GAIN_STABILITY} x the reference's AND it reaches the target loss in <= "
             f"{GAIN_SPEEDUP} x the reference's steps.", ""]
    if facts["noise"]["sd"] is None:
        lines += ["_No seed replicates, so no difference can be resolved: no verdict is possible._", ""]
    if table:
        lines += [_table(table, ["point", "delta_loss", "95% CI", "resolved", "effective_gain"]), ""]
    lines += [("**Effective gain:** " + ", ".join(f"`{g}`" for g in gains)) if gains else
              "**No design point shows an effective gain** over the reference under these criteria.", ""]
    return lines


def interactions_section(fitted: dict) -> list[str]:
    pairs = stats.interaction_tests(fitted)
    lines = ["## Top two-factor interactions", "",
             "Each interaction added alone to the main-effects fit, nested F test (statsmodels anova_lm); a "
             "screening design cannot hold them all at once, so read these as hints of what to study next.", ""]
    return lines + [_table(pairs, ["factors", "df", "F", "p_value"]) if pairs else "_too few runs to test any_", ""]


def write_report(out_dir: Path, design: list[dict], results: list[dict], cfg) -> dict:
    out_dir = Path(out_dir)
    rows, facts = derived_metrics(design, results, getattr(cfg, "target_loss", None))
    write_csv(out_dir / "results.csv", rows)
    factors = varying_factors(design)
    plots = out_dir / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    plot_loss_curves(plots / "loss_curves.png", results, reference_id(design))
    fitted = stats.fit_main_effects(rows, factors, "final_loss", level_order())
    statuses = {s: sum(r["status"] == s for r in rows) for s in sorted({r["status"] for r in rows})}
    lines = [
        f"# Sweep report: {cfg.grid} ({cfg.budget} budget, model {cfg.model})", "",
        f"{len(rows)} runs: " + ", ".join(f"{n} {s}" for s, n in statuses.items())
        + f". Reference: `{facts['reference']}` ({facts['reference_runs']} finished run(s))"
        + ("" if facts["reference_ok"] else " (did not finish ok: no deltas)")
        + f". Target loss for convergence speed: {_fmt(facts['target_loss'])}"
        + f" (the reference reaches it at step {_fmt(facts['reference_steps_to_target'])} on average).", "",
        *_reference_lines(out_dir, cfg),
        *calibration_section(rows, facts, fitted),
        "## Design", "", design_table(design), "",
        "## Results", "",
        _table(rows, ["trial_id", "seed", "status", "boundary", "final_loss", "delta_loss", "val_perplexity",
                      "stability_index", "steps_to_target", "grad_norm_mean", "peak_memory_mb", "time_per_step_s",
                      "effective_gain"]), "",
        *effects_section(fitted, factors, plots),
        *sensitivity_section(rows, factors, plots),
        *interactions_section(fitted),
        *verdict_section(rows, facts),
        "## Loss curves", "", "![loss curves](plots/loss_curves.png)", "",
    ]
    lines += _problems_section(rows)
    lines += ["", f"TensorBoard (curves and HParams tab): `tensorboard --logdir {out_dir / 'trials'}`", ""]
    atomic_write_text(out_dir / "report.md", "\n".join(lines))
    return {"rows": rows, "effects": fitted["effects"], "facts": facts,
            "gains": list(dict.fromkeys(r["point"] for r in rows if r.get("effective_gain")))}


def _reference_lines(out_dir: Path, cfg) -> list[str]:
    from llmlab.sweep.metrics import reference_lines

    budget = cfg.budget_spec
    ref = reference_lines(out_dir / "data", budget.eval_batches * budget.batch_size)
    if not ref or ref["unigram"] is None:
        return []
    return [f"Reference lines on the {ref['eval_tokens']:,} validation tokens every trial is scored on: uniform "
            f"guess {ref['uniform']:.2f} nats, add-one unigram model of the training split {ref['unigram']:.2f} "
            "nats. A final loss below the unigram line means the model uses context.", ""]


def _problems_section(rows: list[dict]) -> list[str]:
    problems = [r for r in rows if r["status"] not in ("ok", "pending") or r.get("boundary")]
    if not problems:
        return []
    lines = ["## Failed, crashed and boundary trials", ""]
    for row in problems:
        lines.append(f"- `{row['trial_id']}` {row['status']}" + (" (boundary case)" if row.get("boundary") else "")
                     + f": {row.get('failures') or '-'}" + (f"; retried with {row['fallback']}" if row.get("fallback") else ""))
        if row.get("log_tail"):
            lines += ["", "```", row["log_tail"], "```", ""]
    return lines
