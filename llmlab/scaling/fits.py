"""Feasible region and robust scaling fits for an lr x batch-size sweep.

Every fit is a straight line in log space (a power law), fitted with RANSAC so that a few broken trials
cannot drag it, then given confidence intervals by a residual bootstrap: the batch sizes and learning rates
are fixed by the design, so we resample the inliers' residuals (scipy.stats.bootstrap) rather than the
points themselves, which keeps every resample well posed even with five batch sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from llmlab.core.config import opt
from llmlab.core.errors import UserError

# Cross-entropy of a uniform guess over the GPT-2 vocabulary: a run that ends above it learned nothing.
UNIFORM_GUESS_LOSS = math.log(50257)
# Log-space residual floor for RANSAC: memory is nearly deterministic, so the robust residual scale can be
# ~0; 0.05 in ln units (5 %) keeps honest measurements from being called outliers.
MIN_RANSAC_THRESHOLD = 0.05


@dataclass
class ScalingOptions:
    diverged_loss: float = opt(
        UNIFORM_GUESS_LOSS,
        "a trial whose final loss is above this (or not finite) is "
        "dropped as diverged; the default is ln(50257), a uniform guess over the vocab",
    )
    unstable_std: Optional[float] = opt(
        None,
        "a trial whose early loss std is above this is dropped as unstable "
        "(unset = unstable_factor x the median early loss std of the ok trials)",
    )
    unstable_factor: float = opt(
        3.0,
        "used when unstable_std is not set: unstable = early loss std above this "
        "multiple of the median over the ok trials",
    )
    ransac_threshold: Optional[float] = opt(
        None,
        "RANSAC inlier threshold on ln-space residuals (unset = 3 x "
        "the MAD residual scale of a Theil-Sen fit, at least 0.05)",
    )
    n_bootstrap: int = opt(100, "bootstrap resamples for the confidence intervals")
    confidence: float = opt(0.95, "confidence level of the intervals and bands")
    seed: int = opt(42, "seed for RANSAC and the bootstrap")
    keep_boundary: bool = opt(
        False,
        "keep trials that only finished after a fail-safe retry with a fallback "
        "(clip - 0.1 or warmup 100); by default they are dropped as at the stability edge",
    )
    holdout: str = opt(
        "auto",
        "multi-size scans: largest = fit on the smaller sizes and check the forecast on the "
        "largest; none = skip; auto = largest when there are >= 3 sizes",
    )
    preregistration: Optional[dict] = opt(
        None, "the scan's preregistration.json (with its sha256): the held-out verdict judges that forecast"
    )
    machine_order: Optional[list] = opt(
        None,
        "a scan's machines (numerics groups) in the order it met them: the "
        "first is the reference of every machine term",
    )

    def validate(self) -> None:
        if not 0 < self.confidence < 1:
            raise UserError(f"--confidence must be between 0 and 1, got {self.confidence}")
        if self.n_bootstrap < 10:
            raise UserError(f"--n_bootstrap must be at least 10, got {self.n_bootstrap}")
        if self.unstable_factor <= 0 or (self.unstable_std is not None and self.unstable_std <= 0):
            raise UserError("--unstable_std / --unstable_factor must be > 0")
        if self.holdout not in ("auto", "largest", "none"):
            raise UserError(f"--holdout must be auto, largest or none, got {self.holdout!r}")


def number(value: Any) -> Optional[float]:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def memory_batch(row: dict) -> Optional[float]:
    """Memory follows the micro batch actually on the device, not the effective (accumulated) batch."""
    batch, accumulation = number(row.get("batch_size")), number(row.get("accumulation_steps"))
    if number(row.get("micro_batch_size")):
        return min(number(row["micro_batch_size"]), batch or math.inf)
    if batch and accumulation:
        return float(math.ceil(batch / accumulation))
    return batch


def feasible_region(rows: list[dict], options: ScalingOptions) -> tuple[list[dict], list[dict], dict]:
    """Split trials into feasible ones and dropped ones (each with a reason); returns the thresholds used."""
    ok = [r for r in rows if r.get("status") == "ok"]
    stds = [s for s in (number(r.get("early_loss_std")) for r in ok) if s is not None]
    if options.unstable_std is not None:
        unstable_std, unstable_rule = options.unstable_std, "set by the user"
    elif stds:
        unstable_std = options.unstable_factor * float(np.median(stds))
        unstable_rule = f"{options.unstable_factor:g} x median early loss std of ok trials ({np.median(stds):.4g})"
    else:
        unstable_std, unstable_rule = math.inf, "no early loss std recorded"
    thresholds = {"diverged_loss": options.diverged_loss, "unstable_std": unstable_std, "unstable_rule": unstable_rule}

    feasible, dropped = [], []
    for row in rows:
        status = row.get("status")
        final_loss, early_std = number(row.get("final_loss")), number(row.get("early_loss_std"))
        detail = row.get("error") or row.get("failures")
        if status != "ok":
            reason = f"status {status}" + (f" ({str(detail)[:160]})" if detail else "")
        elif row.get("boundary") and not options.keep_boundary:
            reason = f"boundary: finished only after a retry with fallback {row.get('fallback') or '?'}" + (
                f" (first attempt: {str(detail)[:120]})" if detail else ""
            )
        elif number(row.get("lr")) is None or number(row.get("batch_size")) is None:
            reason = "no lr or batch size recorded"
        elif final_loss is None:
            reason = f"diverged: final loss {row.get('final_loss')!r} is not finite"
        elif final_loss > options.diverged_loss:
            reason = f"diverged: final loss {final_loss:.4g} > {options.diverged_loss:.4g}"
        elif early_std is not None and early_std > unstable_std:
            reason = f"unstable: early loss std {early_std:.4g} > {unstable_std:.4g}"
        else:
            feasible.append(row)
            continue
        dropped.append(
            {
                "trial_id": row.get("trial_id"),
                "lr": row.get("lr"),
                "batch_size": row.get("batch_size"),
                "status": status,
                "reason": reason,
            }
        )
    return feasible, dropped, thresholds


def lr_optimum(trials: list[dict]) -> dict:
    """The best lr at one batch size: the vertex of a parabola in ln(lr) through the grid minimum and its two
    neighbours (loss is locally quadratic in ln lr near the optimum); the grid minimum itself at an edge."""
    by_lr: dict[float, list[float]] = {}
    for row in trials:
        by_lr.setdefault(float(row["lr"]), []).append(float(row["final_loss"]))
    lrs = np.array(sorted(by_lr))
    losses = np.array([np.mean(by_lr[lr]) for lr in lrs])
    best = int(np.argmin(losses))
    best_trial = min(trials, key=lambda r: float(r["final_loss"]))
    result = {
        "n_trials": len(trials),
        "n_lrs": len(lrs),
        "grid_lr": float(lrs[best]),
        "best_final_loss": float(losses[best]),
        "best_trial_id": best_trial.get("trial_id"),
    }
    if best == 0 or best == len(lrs) - 1:
        return {**result, "lr_opt": float(lrs[best]), "method": "grid minimum", "at_edge": True}
    x = np.log(lrs[best - 1 : best + 2])
    curvature, slope, _ = np.polyfit(x, losses[best - 1 : best + 2], 2)
    if curvature <= 0:  # flat (ties): no vertex to trust
        return {**result, "lr_opt": float(lrs[best]), "method": "grid minimum", "at_edge": False}
    vertex = float(np.clip(-slope / (2 * curvature), x[0], x[-1]))
    return {**result, "lr_opt": math.exp(vertex), "method": "parabola in ln(lr)", "at_edge": False}


def _ransac_threshold(features: np.ndarray, target: np.ndarray, options: ScalingOptions) -> float:
    """The user's, or 3 x the MAD residual scale of a Theil-Sen fit (at least MIN_RANSAC_THRESHOLD)."""
    from sklearn.linear_model import TheilSenRegressor

    if options.ransac_threshold is not None:
        return options.ransac_threshold
    robust = TheilSenRegressor(random_state=options.seed).fit(features, target)
    scale = 1.4826 * float(np.median(np.abs(target - robust.predict(features))))
    return max(3.0 * scale, MIN_RANSAC_THRESHOLD)


def fit_loglinear(features: np.ndarray, target: np.ndarray, options: ScalingOptions, names: list[str]) -> dict:
    """ln-space linear fit y = w0 + w . x with RANSAC outlier rejection and residual-bootstrap intervals."""
    # long: 71 lines once ruff's layout puts its long calls one argument a line; one step, read top to bottom
    from scipy import stats
    from sklearn.linear_model import LinearRegression, RANSACRegressor

    features = np.asarray(features, dtype=float).reshape(len(target), -1)
    target = np.asarray(target, dtype=float)
    n, p = features.shape
    threshold = _ransac_threshold(features, target, options)
    note = ""
    try:
        ransac = RANSACRegressor(
            LinearRegression(),
            min_samples=p + 1,
            residual_threshold=threshold,
            max_trials=1000,
            random_state=options.seed,
        ).fit(features, target)
        inliers = ransac.inlier_mask_.copy()
    except ValueError:
        inliers = np.ones(n, dtype=bool)
        note = "RANSAC found no consensus set; fitted all points"
    if inliers.sum() < p + 2:
        inliers[:] = True
        note = f"RANSAC kept fewer than {p + 2} inliers; fitted all points"
    # RANSAC's consensus comes from a noisy minimal-sample model; re-deciding inliers against the refit on
    # the whole consensus set stops it from trimming honest Gaussian tails (one local-optimisation step).
    model = LinearRegression().fit(features[inliers], target[inliers])
    polished = np.abs(target - model.predict(features)) <= threshold
    if polished.sum() >= p + 2 and not note:
        inliers = polished
    x_in, y_in = features[inliers], target[inliers]
    model = LinearRegression().fit(x_in, y_in)
    fitted = model.predict(x_in)
    n_in = len(y_in)
    # Rescale residuals so their spread matches the noise, not the (smaller) post-fit residual spread, and
    # widen by t/z: with five batch sizes a plain percentile bootstrap covers the truth only ~75 % of the time.
    dof = n_in - (p + 1)
    quantile = (1 + options.confidence) / 2
    widen = stats.t.ppf(quantile, dof) / stats.norm.ppf(quantile)
    residuals = (y_in - fitted) * math.sqrt(n_in / dof) * widen

    def refit(resampled: np.ndarray) -> np.ndarray:
        refitted = LinearRegression().fit(x_in, fitted + resampled)
        return np.concatenate([[refitted.intercept_], refitted.coef_])

    boot = stats.bootstrap(
        (residuals,),
        refit,
        n_resamples=options.n_bootstrap,
        vectorized=False,
        method="percentile",
        confidence_level=options.confidence,
        rng=np.random.default_rng(options.seed),
    )
    params = np.concatenate([[model.intercept_], model.coef_])
    ss_res, ss_tot = float(np.sum((y_in - fitted) ** 2)), float(np.sum((y_in - y_in.mean()) ** 2))
    return {
        "names": names,
        "params": params.tolist(),
        "ci_low": np.atleast_1d(boot.confidence_interval.low).tolist(),
        "ci_high": np.atleast_1d(boot.confidence_interval.high).tolist(),
        "bootstrap_params": boot.bootstrap_distribution.T.tolist(),
        "inliers": inliers.tolist(),
        "n_points": n,
        "n_inliers": int(inliers.sum()),
        "ransac_threshold": threshold,
        "r2_log": 1 - ss_res / ss_tot if ss_tot > 1e-12 else None,  # None: the data do not vary
        "residual_std_log": float(np.std(y_in - fitted, ddof=p + 1)),
        "note": note,
    }


def predict_band(fit: dict, features: np.ndarray, confidence: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ln-space prediction and its bootstrap band at `features` (shape [m, p])."""
    features = np.atleast_2d(np.asarray(features, dtype=float))
    params = np.asarray(fit["params"])
    samples = np.asarray(fit["bootstrap_params"])
    center = params[0] + features @ params[1:]
    draws = samples[:, :1] + samples[:, 1:] @ features.T  # [resamples, m]
    tail = (1 - confidence) / 2 * 100
    return center, np.percentile(draws, tail, axis=0), np.percentile(draws, 100 - tail, axis=0)


def _power_law(fit: dict, coefficient: str, exponent: str) -> dict:
    """Name the ln-space parameters of a one-feature fit as coefficient * batch^exponent."""
    return {
        **fit,
        "status": "ok",
        coefficient: math.exp(fit["params"][0]),
        f"{coefficient}_ci": [math.exp(fit["ci_low"][0]), math.exp(fit["ci_high"][0])],
        exponent: fit["params"][1],
        f"{exponent}_ci": [fit["ci_low"][1], fit["ci_high"][1]],
    }


def unavailable(reason: str) -> dict:
    return {"status": "unavailable", "reason": reason}


def lr_batch_fit(lr_points: list[dict], options: ScalingOptions) -> dict:
    # One surviving lr says nothing about where the optimum is; such batch sizes are listed but not fitted.
    usable = [p for p in lr_points if p["n_lrs"] >= 2]
    # An optimum at the edge of the lr grid is only a bound; fit on interior optima when there are enough.
    interior = [p for p in usable if not p["at_edge"]]
    edge_batches = [p["batch_size"] for p in usable if p["at_edge"]]
    warning = ""
    if len(interior) >= 3:
        usable = interior
    elif edge_batches:
        warning = (
            f"the best lr is at the edge of the lr grid at batch size(s) "
            f"{', '.join(f'{b:g}' for b in edge_batches)}: the fit and its interval only bound lr_opt there; "
            f"widen --lrs"
        )
    if len(usable) < 3:
        return unavailable(
            f"needs feasible trials at >= 3 batch sizes (each with >= 2 learning rates to locate "
            f"the best one), found {len(usable)}"
        )
    x = np.log([p["batch_size"] for p in usable])
    y = np.log([p["lr_opt"] for p in usable])
    fit = fit_loglinear(x, y, options, ["ln a", "b"])
    for point, inlier in zip(usable, fit["inliers"]):
        point["inlier"] = inlier
    return {
        "formula": "lr_opt = a * batch^b",
        **_power_law(fit, "a", "b"),
        "x_range": [float(np.exp(x.min())), float(np.exp(x.max()))],
        "warning": warning,
    }


def memory_fit(rows: list[dict], options: ScalingOptions) -> dict:
    # Memory does not depend on whether the loss behaved, so every trial that ran to the end counts here.
    completed = [
        r for r in rows if r.get("status") == "ok" and memory_batch(r) and (number(r.get("peak_memory_mb")) or 0) > 0
    ]
    batches = sorted({memory_batch(r) for r in completed})
    if len(completed) < 3 or len(batches) < 2:
        single = (
            f"; every trial ran micro batches of {batches[0]:g} (gradient accumulation), so memory was never "
            f"measured at another batch -- rerun with --micro_batch_size >= the largest batch"
            if len(batches) == 1
            else ""
        )
        return unavailable(
            f"needs >= 3 completed trials with peak memory over >= 2 micro batch sizes, found "
            f"{len(completed)} over {len(batches)}{single}"
        )
    x = np.log([memory_batch(r) for r in completed])
    y = np.log([float(r["peak_memory_mb"]) for r in completed])
    fit = fit_loglinear(x, y, options, ["ln c", "d"])
    return {
        "formula": "peak_mem_mb = c * batch^d",
        **_power_law(fit, "c", "d"),
        "x_range": [batches[0], batches[-1]],
        "trial_ids": [r.get("trial_id") for r in completed],
    }


def loss_std_fit(feasible: list[dict], options: ScalingOptions) -> dict:
    with_std = [r for r in feasible if (number(r.get("early_loss_std")) or 0) > 0]
    if len(with_std) < 4 or len({r["lr"] for r in with_std}) < 2 or len({r["batch_size"] for r in with_std}) < 2:
        return unavailable(
            f"needs >= 4 feasible trials with an early loss std over >= 2 lrs and >= 2 batch "
            f"sizes, found {len(with_std)}"
        )
    x = np.array([[math.log(1 / float(r["lr"])), math.log(float(r["batch_size"]))] for r in with_std])
    y = np.log([float(r["early_loss_std"]) for r in with_std])
    fit = fit_loglinear(x, y, options, ["k0", "k1", "k2"])
    names = ["k0", "k1", "k2"]
    return {
        "formula": "ln loss_std = k0 + k1 * ln(1/lr) + k2 * ln(batch)",
        "status": "ok",
        **fit,
        **{name: fit["params"][i] for i, name in enumerate(names)},
        **{f"{name}_ci": [fit["ci_low"][i], fit["ci_high"][i]] for i, name in enumerate(names)},
        "trial_ids": [r.get("trial_id") for r in with_std],
    }
