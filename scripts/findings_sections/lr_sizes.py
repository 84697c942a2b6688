"""The lr scans across sizes, standard and muP, and the second forecasts' summaries."""

from __future__ import annotations

import json
import math

from findings_sections.common import FINDINGS, _ci_text, _verdict_text, lr_scan, trial_results
from llmlab.scaling.transfer import flat_forecast, flat_verdict, registered_trials


def _cells_text(transfer: dict) -> str:
    measured = [p["size"] for p in transfer["points"] if p["status"] == "measured"]
    bounds = [f"{p['size']} ({p['status'].replace('_', ' ')})" for p in transfer["points"] if p["status"] != "measured"]
    return f"{len(measured)} of {len(transfer['points'])} cells measured ({', '.join(measured) or 'none'})" + (
        f"; bounds: {', '.join(bounds)}" if bounds else ""
    )


def lr_summary(name: str, label: str) -> str:
    transfer = lr_scan(name)
    if transfer is None:
        return f"_{name}: not run yet_"
    law, holdout, noise = transfer["law"], transfer["holdout"], transfer["noise"]
    per_size = sorted((v["sigma"], size) for size, v in noise["per_size"].items() if v["sigma"])
    trend = noise.get("lr_trend") or {}
    noise_text = (
        f"seed noise σ = {noise['sigma']:.4f} nats pooled ({noise['df']} df), per size from "
        f"{per_size[0][0]:.4f} ({per_size[0][1]}) to {per_size[-1][0]:.4f} ({per_size[-1][1]})"
        + (
            f", growing with lr (slope of ln s² on ln lr {trend['slope_ln_var']:+.2f} "
            f"[{trend['ci'][0]:+.2f}, {trend['ci'][1]:+.2f}], p = {trend['p']:.2g})"
            if trend.get("used")
            else ""
        )
    )
    head = f"{label} ({transfer['points'][0]['seeds_per_lr']:.0f} seeds per lr): {_cells_text(transfer)}; {noise_text}."
    if holdout.get("status") != "ok":
        law_text = (
            f" All measured sizes: α = {law['alpha']:.3f} [{law['alpha_ci'][0]:.3f}, {law['alpha_ci'][1]:.3f}] "
            f"({law['df']} df)."
            if law["status"] == "ok"
            else " No law: too few measured cells."
        )
        return head + f" **held-out: not run** ({holdout.get('reason')}).{law_text}"
    row = holdout["rows"][0]
    ratio = (
        f"forecast / measured = {row['ratio']:.2f} (90 % CI [{row['ci90'][0]:.2f}, {row['ci90'][1]:.2f}], "
        f"95 % CI [{row['ci95'][0]:.2f}, {row['ci95'][1]:.2f}])"
        if "ratio" in row
        else row.get("reason", "")
    )
    fit, flat = holdout["fit"], row.get("flat")
    flat_text = (
        f" **muP's flat prediction: {flat['verdict']}** — the fit sizes' mean lr_opt {flat['predicted']:.3g} / "
        f"measured = {flat['ratio']:.2f} {_ci_text(flat)}."
        if flat
        else ""
    )
    return (
        head + f" **held-out: {holdout['verdict']}** — fitted on {', '.join(holdout['fitted_on'])} (α = "
        f"{fit['alpha']:.3f} [{fit['alpha_ci'][0]:.3f}, {fit['alpha_ci'][1]:.3f}], {fit['df']} df), the law "
        f"forecast {holdout['size']} ({holdout['extrapolation']:.1f}× beyond in N): {ratio}. All measured sizes: "
        f"α = {law['alpha']:.3f} [{law['alpha_ci'][0]:.3f}, {law['alpha_ci'][1]:.3f}] ({law['df']} df); lack of "
        f"fit τ = {law['tau']:.3f} in ln lr." + flat_text
    )


def flat_control(name: str = "lr-forecast-sp") -> str:
    """muP's flat-prediction test applied to the standard scan, whose optimum moves: the test's positive control."""
    transfer = lr_scan(name)
    held = next(p for p in transfer["points"] if p["size"] == transfer["holdout"]["size"])
    forecast = flat_forecast([p for p in transfer["points"] if p is not held])
    flat = flat_verdict(forecast, held)
    return (
        f"Applied to the standard scan, whose optimum falls with N, the same test **{flat['verdict']}**: the mean "
        f"lr_opt of {forecast['sizes'][0]}-{forecast['sizes'][-1]}, {flat['predicted']:.3g}, against "
        f"{held['size']}'s measured {held['lr_opt']:.3g} gives R = {flat['ratio']:.2f} (95 % CI "
        f"[{flat['ci95'][0]:.2f}, {flat['ci95'][1]:.2f}], {flat['df']} df). So the test can tell a moving optimum "
        "from a flat one at this scan's noise."
    )


def second_forecasts() -> str:
    """The README's lines on the second forecasts (issue 33): each scan's registered verdicts, R = forecast /
    measured lr_opt at the held-out size, or how far its held-out trials got."""
    lines = []
    for name, label in (("lr-forecast-sp", "Standard parametrisation"), ("lr-forecast-mup", "muP")):
        registered = json.loads((FINDINGS / name / "preregistration.json").read_text())
        held = registered["held_out"]
        holdout = lr_scan(name)["holdout"]
        row = holdout["rows"][0] if holdout.get("status") == "ok" and holdout.get("size") == held else {}
        head = f"- {label} ([`{name}/`](docs/findings/{name}/forecast_design.md)), {held} held out: "
        if "ratio" not in row:
            done = sum(1 for r in trial_results(FINDINGS / name) if r["hparams"]["size"] == held)
            planned = registered_trials(registered, held)
            lines.append(head + f"{done} of its {planned} registered held-out trials have run; no verdict yet.")
            continue
        flat = row.get("flat")
        lines.append(
            head
            + ("the law's forecast " if flat else "")
            + _verdict_text(row)
            + (f"; muP's flat prediction {_verdict_text(flat)}" if flat else "")
            + f". At the verdict's own SE, a 1.5x miss is caught {row['power']['detect_1.5x_miss']:.0%} of the time."
        )
    return "\n".join(lines)


def mup_vs_std() -> str:
    std, mup = lr_scan("lr-sizes-std"), lr_scan("lr-sizes-mup")
    if std is None or mup is None:
        return "_the muP comparison needs both scans_"
    a_std, a_mup = std["law"], mup["law"]
    if a_std["status"] != "ok" or a_mup["status"] != "ok":
        return (
            "No comparison of α: at 2 seeds per lr too few cells of "
            + " and ".join(n for n, a in (("the standard scan", a_std), ("the muP scan", a_mup)) if a["status"] != "ok")
            + " are measurements (the rest are bounds), so the earlier claim about muP's α is withdrawn."
        )
    low, high = a_mup["alpha_ci"]
    excludes = not low <= a_std["alpha"] <= high
    drift = (math.exp(low * math.log(100)), math.exp(high * math.log(100)))
    return (
        f"α with muP = {a_mup['alpha']:.3f} [{low:.3f}, {high:.3f}] against the standard α = {a_std['alpha']:.3f}: "
        f"the muP interval **{'excludes' if excludes else 'does not exclude'}** the standard α; over 100× in N it "
        f"still allows lr_opt to move {drift[0]:.2f}–{drift[1]:.2f}×, so it does not show that lr_opt stays put."
    )
