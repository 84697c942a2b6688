"""lr_opt of one (size, batch) cell, with a confidence interval, and how forgiving the cell is of a wrong lr.

The estimator (ESTIMATOR below: what a pre-registration records). Loss against ln lr is close to a parabola near its
minimum. Every run of WINDOW (5) consecutive scanned lrs that contains the lowest seed-mean loss gets a weighted
quadratic in ln lr; lr_opt is the mean of the vertices of the windows whose vertex lies inside them. Averaging over
every bracketing window, instead of preferring one, leaves no choice to be made after the data are seen.

Its interval is a parametric bootstrap of the whole estimator: a smooth curve (one quadratic over the lrs those
windows span, its noise scaled up by the Birge ratio where it misses them) plus Gaussian seed noise at each lr
(sigma at that lr, from the pure error, / sqrt(seeds)), re-estimated BOOTSTRAP times. The draws' errors (each draw
minus the same estimator on the smooth curve) are set around the point estimate (the basic bootstrap), so the point
and its interval come from one estimator: v2 put the percentile interval of the draws themselves beside the point,
centred on the smooth curve's vertex, which could leave the point outside its own interval.

A draw without a vertex inside the grid (its minimum on the first or last lr, or no bracketing window) is censored: it
counts on the side its minimum points to and is never clipped to a value. When more than CENSOR_SHARE of the draws are
censored on one side the 95 % interval is open there, so the cell is a bound (`censored_low` / `censored_high`), not a
measurement: the scan extends the grid there (llmlab.scaling.scan) and the fits across sizes leave it out. The variance
a fit uses is the squared half-width of the central 68 % of the draws, which censored draws (at +-inf) only widen.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

WINDOW = 5  # lrs in each quadratic: a 5-point window at sqrt(2) spacing spans 4x
BOOTSTRAP = 2000
SEED = 0
CENSOR_SHARE = 0.025  # per side: from there on the 95 % interval is open on that side
FAR = 1e6  # where a censored draw is placed, in ln lr
ESTIMATOR = {
    "name": "bracketing-window-mean/v3",
    "vertex": f"mean vertex of every {WINDOW}-lr window containing the seed-mean minimum whose weighted quadratic in "
    "ln lr has its vertex inside the window",
    "interval": f"parametric bootstrap of the whole estimator ({BOOTSTRAP} draws, seed {SEED}) around one quadratic "
    "over the bracketing windows' lrs, Birge-scaled seed noise sigma(size, lr) / sqrt(seeds); the draws' errors "
    "(draw - the estimator on that quadratic) set around the point estimate (basic bootstrap)",
    "censoring": f"a draw with its minimum on the grid's edge or no bracketing window is censored on that side; "
    f">= {CENSOR_SHARE:.1%} censored on a side makes the cell a bound (extend the grid), never a value",
    "variance": "((q84 - q16) / 2)^2 of the draws, censored draws at +-inf",
    "noise": "pure-error sigma per size (pooled over sizes below 5 df), times exp(b/2 (ln lr - mean ln lr)) when the "
    "lr slope b of ln s^2 is significant at 5 %",
}


# Earlier versions whose vertex and variance, all a verdict uses, this one computes the same way (v3 only centres the
# displayed interval on the point): a registration that recorded one is judged as registered.
SAME_VERDICT = ("bracketing-window-mean/v2",)


def finite(value) -> Optional[float]:
    """A float, or None for missing / non-numeric / non-finite values."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def lr_table(trials: list[dict]) -> tuple[np.ndarray, list[list[float]]]:
    """Sorted distinct lrs of a cell and the final losses of each lr's seeds (feasible trials only)."""
    by_lr: dict[float, list[float]] = {}
    for row in trials:
        by_lr.setdefault(float(row["lr"]), []).append(float(row["final_loss"]))
    lrs = np.array(sorted(by_lr))
    return lrs, [by_lr[lr] for lr in lrs]


def seed_counts(trials: list[dict], lrs: np.ndarray) -> np.ndarray:
    """Seeds per lr, each worth its `seed_weight` (below 1 once a machine offset was estimated and removed,
    llmlab.scaling.machines), else 1."""
    counts = dict.fromkeys(lrs.tolist(), 0.0)
    for row in trials:
        counts[float(row["lr"])] += float(row.get("seed_weight", 1.0))
    return np.array([counts[lr] for lr in lrs.tolist()])


def pure_error(groups: list[list[float]], lost_df: int = 0) -> tuple[Optional[float], int]:
    """Pooled within-group SD of repeated runs (same settings, different seeds) and its degrees of freedom;
    `lost_df`: parameters already fitted to these values (machine offsets removed before, scaling.machines)."""
    ss, df = 0.0, -lost_df
    for values in groups:
        if len(values) >= 2:
            ss += float(np.sum((np.asarray(values) - np.mean(values)) ** 2))
            df += len(values) - 1
    return (math.sqrt(ss / df), df) if df > 0 else (None, 0)


def _quadratic(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least-squares coefficients [c2, c1, c0] of y = c2 x^2 + c1 x + c0 (several y columns at once)."""
    root = np.sqrt(w)
    design = np.stack([x**2, x, np.ones_like(x)], axis=1) * root[:, None]
    coef, *_ = np.linalg.lstsq(design, y * (root[:, None] if y.ndim == 2 else root), rcond=None)
    return coef


def window_vertices(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The estimator on columns of seed-mean losses y (lrs x draws): per column the vertex (NaN when censored), the
    index of its minimum, and which windows bracketed it (windows x draws)."""
    n, size = len(x), min(WINDOW, len(x))
    best = np.argmin(y, axis=0)
    starts = range(n - size + 1)
    vertices = np.full((len(starts), y.shape[1]), np.nan)
    for s in starts:
        xs = x[s : s + size]
        centre = float(xs.mean())
        c2, c1, _ = _quadratic(xs - centre, y[s : s + size], w[s : s + size])
        with np.errstate(divide="ignore", invalid="ignore"):
            vertex = centre - c1 / (2 * c2)
        ok = (c2 > 0) & (vertex >= xs[0]) & (vertex <= xs[-1]) & (best >= s) & (best < s + size)
        vertices[s] = np.where(ok, vertex, np.nan)
    brackets = ~np.isnan(vertices)
    count = brackets.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        estimate = np.where(count > 0, np.where(brackets, vertices, 0.0).sum(axis=0) / count, np.nan)
    estimate[(best == 0) | (best == n - 1)] = np.nan
    return estimate, best, brackets


def cell_optimum(trials: list[dict], sigma, confidence: float = 0.95) -> dict:
    """lr_opt of one cell from its feasible trials. `sigma`: the seed SD, one number or a function of the lr array.
    `status`: measured (an interior vertex with a CI), below_grid / above_grid (the minimum is on the grid's edge),
    censored_low / censored_high (the bootstrap puts more than CENSOR_SHARE of the vertex beyond that side of the
    grid), no_vertex (no window around the minimum brackets a parabola's vertex), or too_few. Only `measured` is a
    value; the rest are bounds."""
    lrs, losses = lr_table(trials)
    means = np.array([np.mean(v) for v in losses])
    seeds = seed_counts(trials, lrs)
    base = {
        "n_lrs": len(lrs),
        "n_trials": sum(len(v) for v in losses),
        "seeds_per_lr": float(np.median(seeds)) if len(lrs) else 0,
        "lr_range": [float(lrs[0]), float(lrs[-1])] if len(lrs) else None,
        "estimator": ESTIMATOR["name"],
    }
    if len(lrs) < 3:
        return {
            **base,
            "status": "too_few",
            "lr_opt": None,
            "reason": f"{len(lrs)} feasible lr(s); a vertex needs >= 3",
        }
    x = np.log(lrs)
    estimate, best, brackets = window_vertices(x, means[:, None], seeds)
    best = int(best[0])
    base.update(grid_lr=float(lrs[best]), best_loss=float(means[best]), lr_opt=float(lrs[best]))
    if best == 0 or best == len(lrs) - 1:
        edge = "smallest" if best == 0 else "largest"
        reason = f"the lowest seed-mean loss is at the {edge} scanned lr"
        return {**base, "status": "below_grid" if best == 0 else "above_grid", "reason": reason}
    if math.isnan(estimate[0]):
        reason = "no window of lrs around the minimum puts a parabola's vertex inside it"
        return {**base, "status": "no_vertex", "reason": reason}
    vertex = float(estimate[0])
    used = np.flatnonzero(brackets[:, 0])
    span = slice(int(used[0]), int(used[-1]) + min(WINDOW, len(lrs)))
    result = {
        **base,
        "status": "measured",
        "window": [float(lrs[span][0]), float(lrs[span][-1])],
        "window_lrs": int(len(lrs[span])),
        "windows": int(len(used)),
        "ln_lr_opt": vertex,
        "lr_opt": math.exp(vertex),
    }
    sigmas = _sigma_per_lr(sigma, lrs)
    if sigmas is None:
        return {
            **result,
            "var_ln": None,
            "ci": None,
            "censored_share": None,
            "reason": "no seed SD to put an interval on the vertex",
        }
    return _with_interval(result, x, means, seeds, sigmas, span, confidence)


def _with_interval(
    result: dict, x: np.ndarray, means: np.ndarray, seeds: np.ndarray, sigmas: np.ndarray, span: slice, confidence
) -> dict:
    """The measured vertex with its bootstrap interval and variance, or a censored bound (the module's docstring)."""
    vertex = result["ln_lr_opt"]
    truth, birge, curve = _smooth_curve(x, means, seeds, sigmas, span)
    result.update(
        loss_at_opt=curve["loss_at_opt"],
        curvature=curve["curvature"],
        sigma=float(np.median(sigmas)),
        birge_ratio=birge,
    )
    rng = np.random.default_rng(SEED)
    noise = rng.normal(0.0, 1.0, (len(x), BOOTSTRAP)) * (birge * sigmas / np.sqrt(seeds))[:, None]
    draws, draw_best, _ = window_vertices(x, truth[:, None] + noise, seeds)
    censored = np.isnan(draws)
    low = censored & (draw_best < len(x) / 2)
    high = censored & ~low
    placed = np.where(low, -FAR, np.where(high, FAR, draws))  # beyond any grid, finite so quantiles interpolate
    shares = {"low": float(low.mean()), "high": float(high.mean())}
    tail = (1 - confidence) / 2
    q = np.quantile(placed, [tail, 0.1587, 0.8413, 1 - tail])
    centre = _centre(x, truth, seeds, placed)
    result.update(censored_share=shares["low"] + shares["high"], censored=shares)
    for side in sorted(shares, key=shares.get, reverse=True):  # the more open side names the bound
        if shares[side] >= CENSOR_SHARE:
            return {
                **result,
                "status": f"censored_{side}",
                "var_ln": None,
                "ci": None,
                "reason": f"{shares[side]:.0%} of the bootstrap's vertices fall beyond the {side} end of the grid "
                f"(>= {CENSOR_SHARE:.1%}): the interval is open there; extend the grid or add seeds",
            }
    interval = [vertex - (q[3] - centre), vertex + (centre - q[0])]  # the draws' errors around the point
    return {**result, "var_ln": float(((q[2] - q[1]) / 2) ** 2), "ci": [math.exp(v) for v in interval]}


def _centre(x: np.ndarray, truth: np.ndarray, seeds: np.ndarray, placed: np.ndarray) -> float:
    """The estimator on the bootstrap's smooth curve (what its draws scatter around); the draws' median where the
    curve itself has no bracketed vertex."""
    on_truth = float(window_vertices(x, truth[:, None], seeds)[0][0])
    return on_truth if math.isfinite(on_truth) else float(np.median(placed))


def _sigma_per_lr(sigma, lrs: np.ndarray) -> Optional[np.ndarray]:
    if sigma is None:
        return None
    values = np.asarray(sigma(lrs) if callable(sigma) else np.full(len(lrs), float(sigma)), dtype=float)
    return values if np.all(values > 0) else None


def _smooth_curve(
    x: np.ndarray, means: np.ndarray, seeds: np.ndarray, sigmas: np.ndarray, span: slice
) -> tuple[np.ndarray, float, dict]:
    """The bootstrap's truth: one weighted quadratic over the bracketing windows' lrs (the observed means elsewhere,
    far enough from the minimum that only their order matters) and its Birge ratio sqrt(chi^2 / df) >= 1."""
    w = seeds / sigmas**2
    xs, centre = x[span], float(x[span].mean())
    c2, c1, c0 = _quadratic(xs - centre, means[span], w[span])
    fitted = c2 * (xs - centre) ** 2 + c1 * (xs - centre) + c0
    truth = means.copy()
    truth[span] = fitted
    df = len(xs) - 3
    chi2 = float(np.sum(w[span] * (means[span] - fitted) ** 2))
    birge = math.sqrt(max(1.0, chi2 / df)) if df >= 1 else 1.0
    loss_at_opt = float(c0 - c1**2 / (4 * c2)) if c2 > 0 else float(means[span].min())
    return truth, birge, {"loss_at_opt": loss_at_opt, "curvature": float(c2)}


def grid_extension(lrs: list[float], means: list[float], status: str, step: float) -> list[float]:
    """lrs a scan adds to a cell: two scanned lrs on each side of the seed-mean minimum, and one more past an edge
    the bootstrap leaves open (censored on that side); nothing past a side whose larger lrs diverged (mean inf)."""
    if not any(math.isfinite(m) for m in means):
        return []  # nothing trained: no direction to extend in
    best = int(np.argmin(means))
    below, above = best, len(lrs) - 1 - best
    new = (
        [lrs[0] / step**k for k in range(1, 3 - below)]
        if below < 2
        else ([lrs[0] / step] if status == "censored_low" else [])
    )
    if not any(not math.isfinite(m) for m in means[best + 1 :]):
        new += (
            [lrs[-1] * step**k for k in range(1, 3 - above)]
            if above < 2
            else ([lrs[-1] * step] if status == "censored_high" else [])
        )
    return [float(f"{lr:.3g}") for lr in new]


def lr_sensitivity(
    trials: list[dict], lr_opt: float, initial_loss: Optional[float], span: float = 2**1.5
) -> Optional[dict]:
    """Wortsman et al. (2023): the mean over lrs of min(L(lr), L_init) - L*, here over the scanned lrs within
    [lr_opt / span, lr_opt * span] (the same relative range at every size), L* the lowest seed-mean loss."""
    lrs, losses = lr_table(trials)
    if not len(lrs) or initial_loss is None:
        return None
    means = np.array([np.mean(v) for v in losses])
    inside = (lrs >= lr_opt / span * 0.999) & (lrs <= lr_opt * span * 1.001)
    if inside.sum() < 3:
        return None
    best = float(means.min())
    return {
        "sensitivity": float(np.mean(np.minimum(means[inside], initial_loss) - best)),
        "lrs": int(inside.sum()),
        "range": [float(lrs[inside][0]), float(lrs[inside][-1])],
    }
