"""From small probes to a bigger model: lr_opt per (size, batch) with its interval, the law across sizes, and a
held-out verdict that can fail.

The largest size is held out: the law is fitted on the smaller sizes only and forecasts it, and the forecast /
measured ratio R gets one of three verdicts:
- `within 1.5x`: the 90 % CI of R lies inside [1/1.5, 1.5];
- `failed`: the 95 % CI of R lies entirely outside [1/1.5, 1.5];
- `undecided`: neither; then the analysis says how many seeds per cell, or fit sizes, would decide it.
Var(ln R) = the forecast's variance from the fit (which already carries the lack of fit tau^2 through its weights)
+ the held-out vertex's own variance; the interval uses t on the fit's residual df. Several held-out batches give
several R: the worst one (max |ln R|) is reported, never an average of ratios.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
from scipy import stats

from llmlab.scaling.law import fit_law, predict, ransac_sensitivity
from llmlab.scaling.optimum import cell_optimum, finite, lr_sensitivity, lr_table, pure_error

BAND = 1.5  # a forecast within 1.5x of the optimum costs little loss on the flat bottom of the lr curve
SEED_MULTIPLIERS = (1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32)

# Published fits, as the papers state them (D, C and B in tokens; N non-embedding parameters).
LITERATURE = {
    "Step Law (Li et al. 2025)": {
        "lr": lambda n, d: 1.79 * n ** -0.713 * d ** 0.307, "batch_tokens": lambda n, d: 0.58 * d ** 0.571,
        "alpha": -0.713, "beta": 0.307, "basis": "eta = 1.79 N^-0.713 D^0.307, B = 0.58 D^0.571"},
    "DeepSeek LLM (2024)": {
        "lr": lambda n, d: 0.3118 * (6 * n * d) ** -0.125, "batch_tokens": lambda n, d: 0.2920 * (6 * n * d) ** 0.3271,
        "alpha": -0.125, "beta": -0.125, "basis": "eta = 0.3118 C^-0.125, B = 0.2920 C^0.3271, C = 6 N D here"},
    "muP (Yang et al. 2022)": {
        "lr": None, "batch_tokens": None, "alpha": 0.0, "beta": None,
        "basis": "with the maximal-update parametrisation lr_opt does not move with width"},
}


def _cells(feasible: list[dict]) -> dict[tuple[str, float], list[dict]]:
    cells: dict[tuple[str, float], list[dict]] = {}
    for row in feasible:
        cells.setdefault((str(row.get("size")), float(row["batch_size"])), []).append(row)
    return cells


def seed_noise(feasible: list[dict]) -> dict:
    """sigma: the pooled SD of final loss over seeds at the same (size, batch, lr), per size and overall."""
    groups_by_size: dict[str, list[list[float]]] = {}
    for (size, _), trials in _cells(feasible).items():
        groups_by_size.setdefault(size, []).extend(lr_table(trials)[1])
    per_size = {}
    for size, groups in groups_by_size.items():
        sd, df = pure_error(groups)
        per_size[size] = {"sigma": sd, "df": df}
    sd, df = pure_error([g for groups in groups_by_size.values() for g in groups])
    return {"sigma": sd, "df": df, "per_size": per_size}


def _initial_loss(trials: list[dict]) -> Optional[float]:
    values = [finite(t.get("initial_loss")) for t in trials]
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def size_points(feasible: list[dict], noise: dict, confidence: float = 0.95) -> list[dict]:
    """lr_opt of every (size, batch) cell with its interval, N, tokens and lr sensitivity, smallest N first."""
    points = []
    for (size, batch), trials in _cells(feasible).items():
        sigma = noise["per_size"].get(size, {}).get("sigma") if noise["per_size"].get(size, {}).get("df", 0) >= 5 \
            else noise["sigma"]
        point = {"size": size, "batch_size": batch, "n_params": float(trials[0]["n_params"]),
                 "tokens": finite(trials[0].get("train_tokens")), **cell_optimum(trials, sigma, confidence)}
        if point["status"] == "measured":
            point["sensitivity"] = lr_sensitivity(trials, point["lr_opt"], _initial_loss(trials))
        points.append(point)
    return sorted(points, key=lambda p: (p["n_params"], p["batch_size"]))


def decide(ln_r: float, se: float, df: int) -> dict:
    """The three-way verdict on R = forecast / measured from ln R, its SE and df."""
    t90, t95 = stats.t.ppf(0.95, df), stats.t.ppf(0.975, df)
    ci90 = [math.exp(ln_r - t90 * se), math.exp(ln_r + t90 * se)]
    ci95 = [math.exp(ln_r - t95 * se), math.exp(ln_r + t95 * se)]
    if ci90[0] >= 1 / BAND and ci90[1] <= BAND:
        verdict = f"within {BAND:g}x"
    elif ci95[0] > BAND or ci95[1] < 1 / BAND:
        verdict = "failed"
    else:
        verdict = "undecided"
    return {"verdict": verdict, "ratio": math.exp(ln_r), "ci90": ci90, "ci95": ci95, "se_ln": se, "df": int(df)}


def _forecast_se(fit_points: list[dict], law: dict, held: dict, seed_factor: float = 1.0,
                 extra_sizes: int = 0) -> tuple[float, int]:
    """SE of ln R and its df if every vertex variance shrank by `seed_factor` (more seeds) or `extra_sizes` more
    fit sizes (spread evenly in ln N over the fitted range, at the median variance) were added; tau^2 stays."""
    points = [{**p, "var_ln": (p.get("var_ln") or 0) / seed_factor} for p in fit_points]
    if extra_sizes:
        ns = np.geomspace(law["n_range"][0], law["n_range"][1], extra_sizes + 2)[1:-1]
        median_var = float(np.median([p["var_ln"] for p in points]))
        batch = points[0]["batch_size"]
        points += [{"size": f"extra{i}", "n_params": float(n), "batch_size": batch, "ln_lr_opt": 0.0,
                    "var_ln": median_var} for i, n in enumerate(ns)]
    refit = fit_law(points, law["with_batch"], law["confidence"], tau2=law["tau2"])
    x = np.array([1.0, math.log(held["n_params"])] + ([math.log(held["batch_size"])] if law["with_batch"] else []))
    # the covariance without the Knapp-Hartung scale: the planning question assumes the model's own variances
    cov = np.array(refit["cov"]) / refit["kh_scale"] * law["kh_scale"]
    var = float(x @ cov @ x) + (held.get("var_ln") or 0) / seed_factor
    return math.sqrt(var), refit["df"]


def what_decides(fit_points: list[dict], law: dict, held: dict, ln_r: float) -> dict:
    """For an undecided verdict: the fewest seeds per cell, or extra fit sizes, at which the same ln R would be
    decided (None: not within 32x the seeds / 12 more sizes, e.g. when the lack of fit tau dominates)."""
    seeds_now = held.get("seeds_per_lr") or 1
    seeds = next((math.ceil(seeds_now * k) for k in SEED_MULTIPLIERS
                  if decide(ln_r, *_forecast_se(fit_points, law, held, seed_factor=k))["verdict"] != "undecided"),
                 None)
    sizes = next((m for m in range(1, 13)
                  if decide(ln_r, *_forecast_se(fit_points, law, held, extra_sizes=m))["verdict"] != "undecided"), None)
    return {"seeds_per_cell": seeds, "seeds_now": seeds_now, "extra_fit_sizes": sizes,
            "fit_sizes_now": len({p["size"] for p in fit_points})}


def power(se: float, df: int) -> dict:
    """The design's power: to detect a 1.5x miss (two-sided t test of R = 1 at 5 %), and to call an exact forecast
    `within 1.5x`, at this SE and df."""
    t95, t90 = stats.t.ppf(0.975, df), stats.t.ppf(0.95, df)
    delta = math.log(BAND) / se
    detect = 1 - stats.nct.cdf(t95, df, delta) + stats.nct.cdf(-t95, df, delta)
    confirm = max(0.0, 2 * stats.t.cdf(math.log(BAND) / se - t90, df) - 1)
    return {"detect_1.5x_miss": float(detect), "confirm_exact": float(confirm)}


def holdout_verdict(points: list[dict], confidence: float = 0.95) -> dict:
    """Fit the law on every size but the largest, forecast the largest, and judge the forecast."""
    sizes = sorted({(p["n_params"], p["size"]) for p in points})
    if len(sizes) < 3:
        return {"status": "unavailable", "reason": f"{len(sizes)} sizes: a held-out check needs >= 3 (2 to fit)"}
    (held_n, held_size), (fit_n, _) = sizes[-1], sizes[-2]
    fit_points = [p for p in points if p["size"] != held_size and p["status"] == "measured"]
    law = fit_law(fit_points, confidence=confidence)
    if law["status"] != "ok":
        return {"status": "unavailable", "reason": f"the smaller sizes alone: {law['reason']}"}
    rows = []
    for held in (p for p in points if p["size"] == held_size):
        row: dict[str, Any] = {"batch_size": held["batch_size"], "measured_status": held["status"]}
        forecast = predict(law, held_n, held["batch_size"])
        row.update(predicted=forecast["lr"], prediction_interval=forecast["pi"], measured=held.get("lr_opt"),
                   measured_ci=held.get("ci"))
        if held["status"] != "measured" or held.get("var_ln") is None:
            row.update(verdict="undecided", reason=f"the held-out optimum is not a measurement ({held['status']})")
        else:
            ln_r = forecast["ln_lr"] - held["ln_lr_opt"]
            se = math.sqrt(forecast["se_mean"] ** 2 + held["var_ln"])
            row.update(decide(ln_r, se, law["df"]), power=power(se, law["df"]))
            if row["verdict"] == "undecided":
                row["decided_by"] = what_decides(fit_points, law, held, ln_r)
        rows.append(row)
    judged = [r for r in rows if "ratio" in r]
    worst = max(judged, key=lambda r: abs(math.log(r["ratio"]))) if judged else None
    verdicts = {r["verdict"] for r in rows}
    overall = "failed" if "failed" in verdicts else (f"within {BAND:g}x" if verdicts == {f"within {BAND:g}x"}
                                                     else "undecided")
    return {"status": "ok", "size": held_size, "n_params": held_n, "fitted_on": law["sizes"], "fit": law,
            "extrapolation": held_n / fit_n, "rows": rows, "verdict": overall,
            "worst_ratio": worst["ratio"] if worst else None}


def literature_rows(points: list[dict], law: Optional[dict]) -> list[dict]:
    """Per (size, batch): the measured lr_opt, this lab's law, and each published law at the same N and D."""
    rows = []
    for point in points:
        row: dict[str, Any] = {"size": point["size"], "n_params": point["n_params"], "batch_size": point["batch_size"],
                               "tokens": point["tokens"], "measured": point.get("lr_opt"), "status": point["status"]}
        if law is not None and law.get("status") == "ok":
            row["this lab"] = predict(law, point["n_params"], point["batch_size"])["lr"]
        for name, published in LITERATURE.items():
            if published["lr"] is not None and point["tokens"]:
                row[name] = published["lr"](point["n_params"], point["tokens"])
        rows.append(row)
    return rows


def analyse_sizes(feasible: list[dict], confidence: float = 0.95, holdout: str = "auto") -> dict:
    """Noise, per-cell optima, the law on every measured cell, its RANSAC sensitivity and the held-out verdict."""
    noise = seed_noise(feasible)
    points = size_points(feasible, noise, confidence)
    measured = [p for p in points if p["status"] == "measured"]
    law = fit_law(measured, confidence=confidence)
    n_sizes = len({p["size"] for p in points})
    if holdout == "none":
        verdict: dict = {"status": "skipped", "reason": "--holdout none"}
    elif holdout == "auto" and n_sizes < 3:
        verdict = {"status": "skipped", "reason": f"{n_sizes} sizes: a held-out check needs >= 3 (2 to fit)"}
    else:
        verdict = holdout_verdict(points, confidence)
    return {"sizes": sorted({p["size"] for p in points}, key=lambda s: next(p["n_params"] for p in points
                                                                            if p["size"] == s)),
            "noise": noise, "points": points, "law": law,
            "ransac": ransac_sensitivity(measured, law.get("with_batch", False)) if law["status"] == "ok" else None,
            "bounds": [p for p in points if p["status"] != "measured"], "holdout": verdict,
            "literature": literature_rows(points, law),
            "published": {name: {k: v for k, v in law_.items() if not callable(v)} for name, law_ in LITERATURE.items()}}
