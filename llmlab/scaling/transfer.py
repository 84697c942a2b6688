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
from scipy import special, stats
from statsmodels.regression import linear_model as sm  # OLS/WLS only: statsmodels.api costs ~1 s more to import

from llmlab.scaling.law import fit_law, predict, ransac_sensitivity
from llmlab.scaling.machines import machine_adjust, machine_of
from llmlab.scaling.optimum import cell_optimum, finite, lr_sensitivity, lr_table, pure_error

BAND = 1.5  # a forecast within 1.5x of the optimum costs little loss on the flat bottom of the lr curve
SEED_MULTIPLIERS = (1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32)

# Published fits, as the papers state them (D, C and B in tokens; N non-embedding parameters).
LITERATURE = {
    "Step Law (Li et al. 2025)": {
        "lr": lambda n, d: 1.79 * n**-0.713 * d**0.307,
        "batch_tokens": lambda n, d: 0.58 * d**0.571,
        "alpha": -0.713,
        "beta": 0.307,
        "basis": "eta = 1.79 N^-0.713 D^0.307, B = 0.58 D^0.571",
    },
    "DeepSeek LLM (2024)": {
        "lr": lambda n, d: 0.3118 * (6 * n * d) ** -0.125,
        "batch_tokens": lambda n, d: 0.2920 * (6 * n * d) ** 0.3271,
        "alpha": -0.125,
        "beta": -0.125,
        "basis": "eta = 0.3118 C^-0.125, B = 0.2920 C^0.3271, C = 6 N D here",
    },
    "muP (Yang et al. 2022)": {
        "lr": None,
        "batch_tokens": None,
        "alpha": 0.0,
        "beta": None,
        "basis": "with the maximal-update parametrisation lr_opt does not move with width",
    },
}


def _cells(feasible: list[dict]) -> dict[tuple[str, float], list[dict]]:
    cells: dict[tuple[str, float], list[dict]] = {}
    for row in feasible:
        cells.setdefault((str(row.get("size")), float(row["batch_size"])), []).append(row)
    return cells


def seed_noise(feasible: list[dict], lost_df: Optional[dict[str, int]] = None) -> dict:
    """sigma: the pooled SD of final loss over seeds at the same (size, batch, lr), per size and overall, and whether
    it grows with lr: the slope b of ln s^2 on ln lr within sizes (each group's ln s^2 corrected for its df's bias,
    weighted by df), used only when it differs from 0 at 5 %. `lost_df`: per size, the machine offsets already
    removed from these losses (llmlab.scaling.machines), which the pure error's df must not count."""
    lost_df = lost_df or {}
    groups_by_size: dict[str, list[list[float]]] = {}
    trend_rows = []
    for (size, _), trials in _cells(feasible).items():
        lrs, groups = lr_table(trials)
        groups_by_size.setdefault(size, []).extend(groups)
        trend_rows += [(size, math.log(lr), values) for lr, values in zip(lrs, groups) if len(values) >= 2]
    per_size = {}
    for size, groups in groups_by_size.items():
        sd, df = pure_error(groups, lost_df.get(size, 0))
        per_size[size] = {"sigma": sd, "df": df}
    sd, df = pure_error([g for groups in groups_by_size.values() for g in groups], sum(lost_df.values()))
    trend = _noise_trend(trend_rows)
    for size, entry in per_size.items():
        entry["mean_ln_lr"] = (
            float(np.mean([x for s, x, _ in trend_rows if s == size]))
            if any(s == size for s, _, _ in trend_rows)
            else None
        )
    return {"sigma": sd, "df": df, "per_size": per_size, "lr_trend": trend}


def _noise_trend(rows: list[tuple[str, float, list[float]]]) -> dict:
    """Slope of ln s^2 on ln lr with a fixed level per size. E[ln s^2] = ln sigma^2 + psi(df/2) - ln(df/2), and
    Var(ln s^2) = psi'(df/2), so each group is bias-corrected and weighted by 1 / psi'(df/2)."""
    usable = [(s, x, v) for s, x, v in rows if np.var(v) > 0]
    sizes = sorted({s for s, _, _ in usable})
    if len(usable) < len(sizes) + 3:
        return {"status": "unavailable", "reason": f"{len(usable)} replicated lrs", "used": False}
    half_df = np.array([(len(v) - 1) / 2 for _, _, v in usable])
    y = np.array([math.log(np.var(v, ddof=1)) for _, _, v in usable]) - (special.digamma(half_df) - np.log(half_df))
    X = np.column_stack([[x for _, x, _ in usable]] + [[1.0 * (s == size) for s, _, _ in usable] for size in sizes])
    fit = sm.WLS(y, X, weights=1 / special.polygamma(1, half_df)).fit(cov_type="fixed scale")
    slope, se = float(fit.params[0]), float(fit.bse[0])
    p = float(2 * stats.norm.sf(abs(slope / se)))
    return {
        "status": "ok",
        "slope_ln_var": slope,
        "se": se,
        "ci": [slope - 1.96 * se, slope + 1.96 * se],
        "p": p,
        "groups": len(usable),
        "used": p < 0.05,
    }


def sigma_model(noise: dict, size: str):
    """sigma of one size as a function of the lr array: that size's pure error (the pooled one when it has < 5
    df), sloped in lr when the data show a trend (seed_noise)."""
    entry = noise["per_size"].get(size, {})
    base = entry.get("sigma") if entry.get("df", 0) >= 5 else noise["sigma"]
    if base is None:
        return None
    trend = noise.get("lr_trend") or {}
    if not trend.get("used") or entry.get("mean_ln_lr") is None:
        return base
    slope, centre = trend["slope_ln_var"], entry["mean_ln_lr"]
    return lambda lrs: base * np.exp(slope / 2 * (np.log(lrs) - centre))


def _initial_loss(trials: list[dict]) -> Optional[float]:
    values = [finite(t.get("initial_loss")) for t in trials]
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def size_points(feasible: list[dict], noise: dict, confidence: float = 0.95) -> list[dict]:
    """lr_opt of every (size, batch) cell with its interval, N, tokens and lr sensitivity, smallest N first."""
    points = []
    for (size, batch), trials in _cells(feasible).items():
        sigma = sigma_model(noise, size)
        point = {
            "size": size,
            "batch_size": batch,
            "n_params": float(trials[0]["n_params"]),
            "tokens": finite(trials[0].get("train_tokens")),
            **cell_optimum(trials, sigma, confidence),
        }
        if point["status"] == "measured":
            point["sensitivity"] = lr_sensitivity(trials, point["lr_opt"], _initial_loss(trials))
        points.append(point)
    return sorted(points, key=lambda p: (p["n_params"], p["batch_size"]))


VERDICT_RULE = {
    "ratio": "R = forecast / measured lr_opt of the held-out size; ln R on t with the law's residual df, "
    "Var(ln R) = the forecast mean's variance + the held-out vertex's variance",
    "within": f"TOST at 5 %: the 90 % CI of R lies inside [1/{BAND:g}, {BAND:g}]",
    "failed": f"the 95 % CI of R excludes 1 and R itself lies outside [1/{BAND:g}, {BAND:g}]",
    "undecided": "neither",
}


def decide(ln_r: float, se: float, df: int) -> dict:
    """The three-way verdict on R = forecast / measured from ln R, its SE and df (VERDICT_RULE)."""
    t90, t95 = stats.t.ppf(0.95, df), stats.t.ppf(0.975, df)
    ci90 = [math.exp(ln_r - t90 * se), math.exp(ln_r + t90 * se)]
    ci95 = [math.exp(ln_r - t95 * se), math.exp(ln_r + t95 * se)]
    if ci90[0] >= 1 / BAND and ci90[1] <= BAND:
        verdict = f"within {BAND:g}x"
    elif (ci95[0] > 1 or ci95[1] < 1) and abs(ln_r) > math.log(BAND):
        verdict = "failed"
    else:
        verdict = "undecided"
    return {"verdict": verdict, "ratio": math.exp(ln_r), "ci90": ci90, "ci95": ci95, "se_ln": se, "df": int(df)}


def _forecast_se(
    fit_points: list[dict], law: dict, held: dict, seed_factor: float = 1.0, extra_sizes: int = 0
) -> tuple[float, int]:
    """SE of ln R and its df if every vertex variance shrank by `seed_factor` (more seeds) or `extra_sizes` more
    fit sizes (spread evenly in ln N over the fitted range, at the median variance) were added; tau^2 stays."""
    points = [{**p, "var_ln": (p.get("var_ln") or 0) / seed_factor} for p in fit_points]
    if extra_sizes:
        ns = np.geomspace(law["n_range"][0], law["n_range"][1], extra_sizes + 2)[1:-1]
        median_var = float(np.median([p["var_ln"] for p in points]))
        batch = points[0]["batch_size"]
        points += [
            {"size": f"extra{i}", "n_params": float(n), "batch_size": batch, "ln_lr_opt": 0.0, "var_ln": median_var}
            for i, n in enumerate(ns)
        ]
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
    seeds = next(
        (
            math.ceil(seeds_now * k)
            for k in SEED_MULTIPLIERS
            if decide(ln_r, *_forecast_se(fit_points, law, held, seed_factor=k))["verdict"] != "undecided"
        ),
        None,
    )
    sizes = next(
        (
            m
            for m in range(1, 13)
            if decide(ln_r, *_forecast_se(fit_points, law, held, extra_sizes=m))["verdict"] != "undecided"
        ),
        None,
    )
    return {
        "seeds_per_cell": seeds,
        "seeds_now": seeds_now,
        "extra_fit_sizes": sizes,
        "fit_sizes_now": len({p["size"] for p in fit_points}),
    }


def power(se: float, df: int) -> dict:
    """Operating characteristics of VERDICT_RULE at this SE and df, treating the SE as known (the whole-pipeline
    simulation, llmlab.scaling.simulate, is the reference): P(the 95 % CI excludes 1), P(failed) and P(within) at a
    true miss of 1.5x and 2x, and at an exact forecast."""
    t95, t90 = stats.t.ppf(0.975, df), stats.t.ppf(0.95, df)
    band = math.log(BAND)

    def beyond(c: float, delta: float) -> float:  # P(|ln R| > c) when ln R ~ delta + se t_df
        return float(stats.t.sf((c - delta) / se, df) + stats.t.cdf((-c - delta) / se, df))

    def within(delta: float) -> float:
        return max(
            0.0,
            float(stats.t.cdf((band - t90 * se - delta) / se, df) - stats.t.cdf((-band + t90 * se - delta) / se, df)),
        )

    return {
        "detect_1.5x_miss": beyond(t95 * se, math.log(1.5)),
        "failed_at_1.5x": beyond(max(t95 * se, band), math.log(1.5)),
        "failed_at_2x": beyond(max(t95 * se, band), math.log(2.0)),
        "failed_at_exact": beyond(max(t95 * se, band), 0.0),
        "within_at_exact": within(0.0),
    }


FLAT_RULE = (
    "muP's own prediction: the held-out lr_opt equals the geometric mean of the fit sizes' measured lr_opt; its SE "
    "is their spread across sizes / sqrt(k) on k - 1 df (it carries their estimation error, any scatter about flat "
    "and any trend the prediction denies), judged by the same verdict rule as the law's forecast"
)


def flat_forecast(fit_points: list[dict]) -> dict:
    """muP's prediction that the optimal lr does not move with width (FLAT_RULE), from the fit sizes' vertices."""
    measured = [p for p in fit_points if p["status"] == "measured"]
    if len(measured) < 2:
        return {"status": "unavailable", "reason": f"{len(measured)} measured fit sizes: the mean needs >= 2"}
    ln = np.array([p["ln_lr_opt"] for p in measured])
    return {
        "status": "ok",
        "lr": float(math.exp(ln.mean())),
        "ln_lr": float(ln.mean()),
        "se_mean": float(ln.std(ddof=1) / math.sqrt(len(ln))),
        "df": len(ln) - 1,
        "sizes": [p["size"] for p in measured],
        "rule": FLAT_RULE,
    }


def flat_verdict(flat: dict, held: dict) -> dict:
    """The flat prediction against the held-out size's measured optimum: R = predicted / measured, VERDICT_RULE."""
    ln_r = flat["ln_lr"] - held["ln_lr_opt"]
    se = math.sqrt(flat["se_mean"] ** 2 + held["var_ln"])
    return {**decide(ln_r, se, flat["df"]), "predicted": flat["lr"], "power": power(se, flat["df"])}


def registered_forecast(registration: Optional[dict], size: str, batch: float) -> Optional[dict]:
    """The pre-registered forecast of (size, batch) as predict() returns one, or None when none was registered."""
    if not registration or registration.get("held_out") != size or float(registration.get("batch_size", -1)) != batch:
        return None
    law = (registration.get("forecast") or {}).get("law")
    if not law:
        return None
    t = stats.t.ppf(0.975, law["df"])
    return {
        "ln_lr": law["ln_lr"],
        "lr": math.exp(law["ln_lr"]),
        "se_mean": law["se_mean"],
        "df": law["df"],
        "pi": [math.exp(law["ln_lr"] - t * law["se_pred"]), math.exp(law["ln_lr"] + t * law["se_pred"])],
        "registered": True,
    }


def registered_trials(registration: Optional[dict], size: str) -> int:
    """Held-out trials the pre-registered design planned (its grid x seeds; 0 without a registration)."""
    if not registration or registration.get("held_out") != size:
        return 0
    design = registration.get("design") or {}
    return len(design.get("held_out_lrs") or []) * int(design.get("held_out_seeds") or 0)


def holdout_verdict(points: list[dict], confidence: float = 0.95, registration: Optional[dict] = None) -> dict:
    """Fit the law on every size but the largest, forecast the largest, and judge the forecast: the pre-registered
    one (llmlab.scaling.scan.preregister) when there is one, else the law refitted now (exploratory)."""
    # long: 62 lines once ruff's layout puts its long calls one argument a line; one step, read top to bottom
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
        forecast = registered_forecast(registration, held_size, held["batch_size"]) or {
            **predict(law, held_n, held["batch_size"]),
            "registered": False,
        }
        row.update(
            predicted=forecast["lr"],
            prediction_interval=forecast["pi"],
            measured=held.get("lr_opt"),
            measured_ci=held.get("ci"),
            registered=forecast["registered"],
            refit_now=predict(law, held_n, held["batch_size"])["lr"],
        )
        planned = registered_trials(registration, held_size)
        if forecast["registered"] and held.get("n_trials", 0) < planned:
            row.update(
                verdict="undecided",
                reason=f"{held.get('n_trials', 0)} of the {planned} registered held-out "
                "trials have finished: no verdict before they all have",
            )
        elif held["status"] != "measured" or held.get("var_ln") is None:
            row.update(verdict="undecided", reason=f"the held-out optimum is not a measurement ({held['status']})")
        else:
            ln_r = forecast["ln_lr"] - held["ln_lr_opt"]
            se = math.sqrt(forecast["se_mean"] ** 2 + held["var_ln"])
            df = forecast.get("df", law["df"])
            row.update(decide(ln_r, se, df), power=power(se, df))
            if row["verdict"] == "undecided":
                row["decided_by"] = what_decides(fit_points, law, held, ln_r)
            flat = (registration or {}).get("flat_forecast") or {}
            if forecast["registered"] and flat.get("status") == "ok":
                row["flat"] = flat_verdict(flat, held)
        rows.append(row)
    judged = [r for r in rows if "ratio" in r]
    worst = max(judged, key=lambda r: abs(math.log(r["ratio"]))) if judged else None
    verdicts = {r["verdict"] for r in rows}
    overall = (
        "failed"
        if "failed" in verdicts
        else (f"within {BAND:g}x" if verdicts == {f"within {BAND:g}x"} else "undecided")
    )
    return {
        "status": "ok",
        "size": held_size,
        "n_params": held_n,
        "fitted_on": law["sizes"],
        "fit": law,
        "extrapolation": held_n / fit_n,
        "rows": rows,
        "verdict": overall,
        "worst_ratio": worst["ratio"] if worst else None,
    }


def literature_rows(points: list[dict], law: Optional[dict]) -> list[dict]:
    """Per (size, batch): the measured lr_opt, this lab's law, and each published law at the same N and D."""
    rows = []
    for point in points:
        row: dict[str, Any] = {
            "size": point["size"],
            "n_params": point["n_params"],
            "batch_size": point["batch_size"],
            "tokens": point["tokens"],
            "measured": point.get("lr_opt"),
            "status": point["status"],
        }
        if law is not None and law.get("status") == "ok":
            row["this lab"] = predict(law, point["n_params"], point["batch_size"])["lr"]
        for name, published in LITERATURE.items():
            if published["lr"] is not None and point["tokens"]:
                row[name] = published["lr"](point["n_params"], point["tokens"])
        rows.append(row)
    return rows


def registered_rows(feasible: list[dict], registration: dict) -> list[dict]:
    """The trials the registration planned: at the held-out size, its registered seeds only (blocks a later machine
    added are not part of the registered design)."""
    held, seeds = registration.get("held_out"), (registration.get("design") or {}).get("held_out_seeds")
    if seeds is None:
        return feasible
    return [r for r in feasible if str(r.get("size")) != held or int(r.get("replicate") or 0) < int(seeds)]


def analyse_sizes(
    feasible: list[dict],
    confidence: float = 0.95,
    holdout: str = "auto",
    registration: Optional[dict] = None,
    machine_order: Optional[list[str]] = None,
) -> dict:
    """Noise, per-cell optima, the law on every measured cell, its RANSAC sensitivity and the held-out verdict.
    Trials from several machines (numerics that differ) are pooled with a machine term (llmlab.scaling.machines);
    a registered verdict is then also given without it, beside the blocked one (as registered, where the
    registration predates the machine term; a sensitivity, where it registered the term)."""
    machines = sorted({machine_of(r) for r in feasible})
    adjusted, machine_terms = machine_adjust(feasible, machine_order)
    lost_df: dict[str, int] = {}
    for term in machine_terms:
        lost_df[term["size"]] = lost_df.get(term["size"], 0) + term["lost_df"]
    noise = seed_noise(adjusted, lost_df)
    points = size_points(adjusted, noise, confidence)
    measured = [p for p in points if p["status"] == "measured"]
    law = fit_law(measured, confidence=confidence)
    n_sizes = len({p["size"] for p in points})
    if holdout == "none":
        verdict: dict = {"status": "skipped", "reason": "--holdout none"}
    elif holdout == "auto" and n_sizes < 3:
        verdict = {"status": "skipped", "reason": f"{n_sizes} sizes: a held-out check needs >= 3 (2 to fit)"}
    else:
        verdict = holdout_verdict(points, confidence, registration)
        if machine_terms:
            verdict["machine_term"] = True
            if registration:
                registered = registered_rows(feasible, registration)
                raw = size_points(registered, seed_noise(registered), confidence)
                # a registration that states the machine term makes the blocked verdict the registered one and the
                # pooled one a sensitivity; one from before that had no machine term, so the pooled one is as registered
                key = "without_machine_term" if registration.get("machine_term") else "as_registered"
                verdict[key] = holdout_verdict(raw, confidence, registration)
    return {
        "sizes": sorted(
            {p["size"] for p in points}, key=lambda s: next(p["n_params"] for p in points if p["size"] == s)
        ),
        "noise": noise,
        "points": points,
        "law": law,
        "machines": machines,
        "machine_terms": machine_terms,
        "ransac": ransac_sensitivity(measured, law.get("with_batch", False)) if law["status"] == "ok" else None,
        "bounds": [p for p in points if p["status"] != "measured"],
        "holdout": verdict,
        "literature": literature_rows(points, law),
        "published": {name: {k: v for k, v in law_.items() if not callable(v)} for name, law_ in LITERATURE.items()},
    }
