"""The law across sizes: ln lr_opt = k0 + alpha ln N (+ beta ln B), by weighted least squares, with no deletions.

Every measured vertex carries its own variance v_i (llmlab.scaling.optimum). A power law never fits a handful of
small models exactly, so the weights are 1 / (v_i + tau^2), where tau^2 is the lack-of-fit variance estimated from
the data (Paule-Mandel: the tau^2 at which the weighted residuals' chi-square equals its degrees of freedom, the
standard random-effects meta-regression estimator). Intervals use Student t on the residual df (n - p) and the
Knapp-Hartung scale, never below 1. A forecast's prediction interval adds tau^2 to the variance of the line.
Without any v_i (no replicates) this is ordinary least squares: tau^2 is then the residual variance.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
from scipy import optimize, stats
from statsmodels.regression import linear_model as sm  # OLS/WLS only: statsmodels.api costs ~1 s more to import

from llmlab.scaling.fits import ScalingOptions, fit_loglinear


def design_matrix(points: list[dict], with_batch: bool) -> np.ndarray:
    columns = [np.ones(len(points)), np.log([p["n_params"] for p in points])]
    if with_batch:
        columns.append(np.log([p["batch_size"] for p in points]))
    return np.column_stack(columns)


def _weighted_q(X: np.ndarray, y: np.ndarray, v: np.ndarray, tau2: float) -> float:
    weights = 1.0 / (v + tau2)
    fit = sm.WLS(y, X, weights=weights).fit()
    return float(np.sum(weights * fit.resid**2))


def paule_mandel(X: np.ndarray, y: np.ndarray, v: np.ndarray) -> float:
    """Between-point (lack-of-fit) variance tau^2 >= 0 with Q(tau^2) = n - p."""
    df = len(y) - X.shape[1]
    if df < 1:
        return 0.0
    if not np.any(v > 0):  # no per-point variances: OLS, tau^2 = residual variance
        fit = sm.OLS(y, X).fit()
        return float(np.sum(fit.resid**2) / df)
    if _weighted_q(X, y, v, 0.0) <= df:
        return 0.0
    upper = float(np.var(y) * 10 + v.max() * 10 + 1e-6)
    return float(optimize.brentq(lambda t2: _weighted_q(X, y, v, t2) - df, 0.0, upper, xtol=1e-10))


def fit_law(
    points: list[dict], with_batch: Optional[bool] = None, confidence: float = 0.95, tau2: Optional[float] = None
) -> dict:
    """Fit the law on measured optima (dicts with n_params, batch_size, ln_lr_opt, var_ln, size)."""
    if with_batch is None:
        with_batch = len({p["batch_size"] for p in points}) >= 3
    names = ["k0", "alpha"] + (["beta"] if with_batch else [])
    X = design_matrix(points, with_batch) if points else np.zeros((0, len(names)))
    df = len(points) - len(names)
    if len({p["n_params"] for p in points}) < 2 or df < 1:
        return {
            "status": "unavailable",
            "reason": f"needs measured optima at >= {len(names) + 1} cells over >= 2 sizes, found {len(points)}",
        }
    y = np.array([p["ln_lr_opt"] for p in points])
    v = np.array([p.get("var_ln") or 0.0 for p in points])
    tau2 = paule_mandel(X, y, v) if tau2 is None else tau2
    weights = 1.0 / (v + tau2) if (v + tau2).min() > 0 else np.ones(len(y))
    fit = sm.WLS(y, X, weights=weights).fit()
    scale = max(1.0, float(np.sum(weights * fit.resid**2)) / df)  # Knapp-Hartung, truncated at 1
    cov = fit.normalized_cov_params * scale
    se = np.sqrt(np.diag(cov))
    t = stats.t.ppf((1 + confidence) / 2, df)
    result = {
        "status": "ok",
        "formula": "ln lr_opt = k0 + alpha ln N" + (" + beta ln B" if with_batch else ""),
        "names": names,
        "with_batch": with_batch,
        "params": fit.params.tolist(),
        "se": se.tolist(),
        "cov": cov.tolist(),
        "df": int(df),
        "tau2": float(tau2),
        "tau": math.sqrt(tau2),
        "kh_scale": scale,
        "n_points": len(points),
        "sizes": sorted({p["size"] for p in points}, key=lambda s: _n_of(points, s)),
        "n_range": [min(p["n_params"] for p in points), max(p["n_params"] for p in points)],
        "residuals": (y - X @ fit.params).tolist(),
        "confidence": confidence,
        "estimator": "WLS, weights 1/(v_i + tau^2), tau^2 Paule-Mandel, Knapp-Hartung t intervals",
    }
    for i, name in enumerate(names):
        result[name] = float(fit.params[i])
        result[f"{name}_ci"] = [float(fit.params[i] - t * se[i]), float(fit.params[i] + t * se[i])]
    return result


def _n_of(points: list[dict], size: str) -> float:
    return next(p["n_params"] for p in points if p["size"] == size)


def predict(law: dict, n_params: float, batch: float, confidence: Optional[float] = None) -> dict:
    """ln lr_opt at (N, B): the line's mean with its CI, and the prediction interval (adds tau^2) on t(df)."""
    confidence = confidence or law["confidence"]
    x = np.array([1.0, math.log(n_params)] + ([math.log(batch)] if law["with_batch"] else []))
    mean = float(x @ np.array(law["params"]))
    se_mean = math.sqrt(float(x @ np.array(law["cov"]) @ x))
    se_pred = math.sqrt(se_mean**2 + law["tau2"])
    t = stats.t.ppf((1 + confidence) / 2, law["df"])
    return {
        "ln_lr": mean,
        "lr": math.exp(mean),
        "se_mean": se_mean,
        "se_pred": se_pred,
        "df": law["df"],
        "ci": [math.exp(mean - t * se_mean), math.exp(mean + t * se_mean)],
        "pi": [math.exp(mean - t * se_pred), math.exp(mean + t * se_pred)],
        "confidence": confidence,
    }


def ransac_sensitivity(points: list[dict], with_batch: bool) -> dict:
    """The same law by RANSAC on the unweighted vertices: a sensitivity check, never the headline."""
    if len(points) < 4:
        return {"status": "unavailable", "reason": "RANSAC needs >= 4 points"}
    X = design_matrix(points, with_batch)[:, 1:]
    fit = fit_loglinear(
        X,
        np.array([p["ln_lr_opt"] for p in points]),
        ScalingOptions(n_bootstrap=200),
        ["k0", "alpha"] + (["beta"] if with_batch else []),
    )
    dropped = [
        p["size"] + (f"/batch {p['batch_size']:g}" if with_batch else "")
        for p, keep in zip(points, fit["inliers"])
        if not keep
    ]
    return {
        "status": "ok",
        "alpha": fit["params"][1],
        "alpha_ci": [fit["ci_low"][1], fit["ci_high"][1]],
        "n_inliers": fit["n_inliers"],
        "n_points": fit["n_points"],
        "dropped": dropped,
    }
