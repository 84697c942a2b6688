"""From small probes to a bigger model: lr_opt across model sizes, a forecast tested on a size it was not fitted on,
and the published laws evaluated at the same N and D.

Joint fit (RANSAC + residual bootstrap, as for one size): ln lr_opt = k0 + alpha ln N + beta ln B, over the best lr
of every (size, batch) cell; N is the non-embedding parameter count, B the batch in sequences. With the lab's
fixed number of steps, D = steps x B x seq grows with B, so beta also carries the data dependence: the
literature's D exponent is its counterpart.

Held-out check: refit without the largest size, forecast that size's lr_opt with the fit's band, and compare with
the lr_opt measured there. Independent checks of published laws have found forecasts off by more than 4x at
billions of parameters; this ratio is this lab's own credibility at its own scale.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from llmlab.scaling.fits import ScalingOptions, fit_loglinear, lr_optimum, predict_band

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


def size_points(feasible: list[dict]) -> list[dict]:
    """The best lr of every (size, batch) cell, with that cell's N and tokens."""
    cells: dict[tuple[str, float], list[dict]] = {}
    for row in feasible:
        cells.setdefault((str(row.get("size")), float(row["batch_size"])), []).append(row)
    points = []
    for (size, batch), trials in sorted(cells.items(), key=lambda kv: (float(kv[1][0]["n_params"]), kv[0][1])):
        points.append({"size": size, "batch_size": batch, "n_params": float(trials[0]["n_params"]),
                       "tokens": float(trials[0].get("train_tokens") or 0) or None, **lr_optimum(trials)})
    return points


def _features(points: list[dict], with_batch: bool) -> np.ndarray:
    columns = [[math.log(p["n_params"]) for p in points]]
    if with_batch:
        columns.append([math.log(p["batch_size"]) for p in points])
    return np.array(columns).T


def joint_fit(points: list[dict], options: ScalingOptions) -> dict:
    """ln lr_opt = k0 + alpha ln N (+ beta ln B when the scan has several batch sizes)."""
    usable = [p for p in points if p["n_lrs"] >= 2]
    interior = [p for p in usable if not p["at_edge"]]
    warning = ""
    if len(interior) >= 4 and len({p["n_params"] for p in interior}) >= 2:
        usable = interior
    elif any(p["at_edge"] for p in usable):
        edges = sorted({f"{p['size']}/batch {p['batch_size']:g}" for p in usable if p["at_edge"]})
        warning = (f"lr_opt sits at the edge of the lr grid for {', '.join(edges)}: there it is a bound, not a "
                   "measurement; widen --lrs")
    with_batch = len({p["batch_size"] for p in usable}) >= 2
    needed = 4 if with_batch else 3
    if len({p["n_params"] for p in usable}) < 2 or len(usable) < needed:
        return {"status": "unavailable", "reason": f"needs best lrs at >= 2 sizes and >= {needed} (size, batch) "
                                                   f"cells, found {len(usable)}"}
    fit = fit_loglinear(_features(usable, with_batch), np.log([p["lr_opt"] for p in usable]), options,
                        ["k0", "alpha"] + (["beta"] if with_batch else []))
    names = fit["names"]
    result = {"status": "ok", "formula": "ln lr_opt = k0 + alpha ln N" + (" + beta ln B" if with_batch else ""),
              "with_batch": with_batch, "warning": warning, **fit,
              "n_range": [min(p["n_params"] for p in usable), max(p["n_params"] for p in usable)],
              "sizes": sorted({p["size"] for p in usable})}
    for i, name in enumerate(names):
        result[name], result[f"{name}_ci"] = fit["params"][i], [fit["ci_low"][i], fit["ci_high"][i]]
    return result


# A held-out band wider than this factor (upper / lower) cannot falsify a forecast; the lr grid itself spans 16x.
UNINFORMATIVE_BAND = 30.0


def band_ratio(holdout: dict) -> float:
    """Upper / lower edge of the widest held-out band."""
    return max(r["band"][1] / r["band"][0] for r in holdout["rows"])


def forecast(fit: dict, n_params: float, batch: float, confidence: float) -> tuple[float, float, float]:
    """lr_opt at (N, B) with its band (bootstrap over the fit's parameters)."""
    features = [math.log(n_params)] + ([math.log(batch)] if fit["with_batch"] else [])
    center, low, high = predict_band(fit, np.array([features]), confidence)
    return float(math.exp(center[0])), float(math.exp(low[0])), float(math.exp(high[0]))


def holdout_check(points: list[dict], options: ScalingOptions) -> dict:
    """Fit on every size but the largest, forecast the largest, compare with its measured lr_opt."""
    sizes = sorted({(p["n_params"], p["size"]) for p in points})
    largest_n, largest = sizes[-1]
    fit = joint_fit([p for p in points if p["size"] != largest], options)
    if fit["status"] != "ok":
        return {"status": "unavailable", "reason": f"the smaller sizes alone: {fit['reason']}"}
    confidence = options.confidence
    rows = []
    for point in (p for p in points if p["size"] == largest and p["n_lrs"] >= 2):
        predicted, low, high = forecast(fit, largest_n, point["batch_size"], confidence)
        rows.append({"batch_size": point["batch_size"], "predicted": predicted, "band": [low, high],
                     "measured": point["lr_opt"], "measured_at_edge": point["at_edge"],
                     "ratio": predicted / point["lr_opt"], "inside": low <= point["lr_opt"] <= high})
    if not rows:
        return {"status": "unavailable", "reason": f"size {largest} has no batch with >= 2 feasible lrs"}
    second_n = sizes[-2][0]
    return {"status": "ok", "size": largest, "n_params": largest_n, "fitted_on": fit["sizes"], "fit": fit,
            "extrapolation": largest_n / second_n, "rows": rows, "all_inside": all(r["inside"] for r in rows),
            "median_ratio": float(np.median([r["ratio"] for r in rows]))}


def literature_rows(points: list[dict], fit: Optional[dict], confidence: float) -> list[dict]:
    """Per (size, batch): the measured lr_opt, this lab's joint fit, and each published law at the same N and D."""
    rows = []
    for point in points:
        row: dict[str, Any] = {"size": point["size"], "n_params": point["n_params"], "batch_size": point["batch_size"],
                               "tokens": point["tokens"], "measured": point["lr_opt"]}
        if fit is not None and fit.get("status") == "ok":
            row["this lab"] = forecast(fit, point["n_params"], point["batch_size"], confidence)[0]
        for name, law in LITERATURE.items():
            if law["lr"] is not None and point["tokens"]:
                row[name] = law["lr"](point["n_params"], point["tokens"])
        rows.append(row)
    return rows


def analyse_sizes(feasible: list[dict], options: ScalingOptions) -> dict:
    points = size_points(feasible)
    sizes = sorted({p["size"] for p in points}, key=lambda s: next(p["n_params"] for p in points if p["size"] == s))
    fit = joint_fit(points, options)
    holdout: dict = {"status": "skipped", "reason": "--holdout none"}
    wanted = options.holdout == "largest" or (options.holdout == "auto" and len(sizes) >= 3)
    if wanted:
        holdout = (holdout_check(points, options) if len(sizes) >= 2 else
                   {"status": "unavailable", "reason": "needs >= 2 sizes"})
    elif options.holdout == "auto":
        holdout = {"status": "skipped", "reason": f"{len(sizes)} sizes: a held-out check needs >= 3 (2 to fit)"}
    return {"sizes": sizes, "points": points, "joint_fit": fit, "holdout": holdout,
            "literature": literature_rows(points, fit, options.confidence),
            "published": {name: {k: v for k, v in law.items() if not callable(v)} for name, law in LITERATURE.items()}}
