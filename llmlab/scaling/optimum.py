"""lr_opt of one (size, batch) cell, with a confidence interval, and how forgiving the cell is of a wrong lr.

Loss against ln lr is close to a parabola near its minimum, so lr_opt is the vertex of a quadratic fitted to the
seed-mean losses of the WINDOW (5) lrs around the seed-mean minimum. Its interval is a parametric bootstrap: the
fitted parabola plus Gaussian noise of the measured seed SD (sigma, from the pure error of the replicates) divided
by sqrt(seeds at that lr), refitted POINTS times. An optimum whose minimum sits on the first or last scanned lr
is a bound, never a measurement: the scan extends the grid there (llmlab.sweep.scan), and the fits across sizes
leave bounds out.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

WINDOW = 5  # lrs in the quadratic: a 5-point window at sqrt(2) spacing spans 4x
BOOTSTRAP = 2000
SEED = 0


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


def pure_error(groups: list[list[float]]) -> tuple[Optional[float], int]:
    """Pooled within-group SD of repeated runs (same settings, different seeds) and its degrees of freedom."""
    ss, df = 0.0, 0
    for values in groups:
        if len(values) >= 2:
            ss += float(np.sum((np.asarray(values) - np.mean(values)) ** 2))
            df += len(values) - 1
    return (math.sqrt(ss / df), df) if df else (None, 0)


def _quadratic(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least-squares coefficients [c2, c1, c0] of y = c2 x^2 + c1 x + c0 (several y columns at once)."""
    root = np.sqrt(w)
    design = np.stack([x ** 2, x, np.ones_like(x)], axis=1) * root[:, None]
    coef, *_ = np.linalg.lstsq(design, y * (root[:, None] if y.ndim == 2 else root), rcond=None)
    return coef


def _window(means: np.ndarray, best: int) -> slice:
    start = int(np.clip(best - WINDOW // 2, 0, max(0, len(means) - WINDOW)))
    return slice(start, min(len(means), start + WINDOW))


def cell_optimum(trials: list[dict], sigma: Optional[float], confidence: float = 0.95) -> dict:
    """lr_opt of one cell from its feasible trials. `status`: measured (an interior vertex with a CI), below_grid /
    above_grid (the minimum is on the grid's edge: a bound), flat (no curvature to locate a vertex), or too_few."""
    lrs, losses = lr_table(trials)
    means = np.array([np.mean(v) for v in losses])
    seeds = np.array([len(v) for v in losses], dtype=float)
    base = {"n_lrs": len(lrs), "n_trials": int(seeds.sum()), "seeds_per_lr": float(np.median(seeds)) if len(lrs) else 0,
            "lr_range": [float(lrs[0]), float(lrs[-1])] if len(lrs) else None}
    if len(lrs) < 3:
        return {**base, "status": "too_few", "lr_opt": None, "reason": f"{len(lrs)} feasible lr(s); a vertex needs >= 3"}
    best = int(np.argmin(means))
    base.update(grid_lr=float(lrs[best]), best_loss=float(means[best]))
    if best == 0 or best == len(lrs) - 1:
        side = "below_grid" if best == 0 else "above_grid"
        return {**base, "status": side, "lr_opt": float(lrs[best]),
                "reason": f"the lowest seed-mean loss is at the {'smallest' if best == 0 else 'largest'} scanned lr"}
    window = _window(means, best)
    x, y, w = np.log(lrs[window]), means[window], seeds[window]
    centre = float(x.mean())
    c2, c1, c0 = _quadratic(x - centre, y, w)
    if c2 <= 0:
        return {**base, "status": "flat", "lr_opt": float(lrs[best]), "reason": "the losses around the minimum have "
                "no upward curvature"}
    vertex = centre - c1 / (2 * c2)
    low_edge, high_edge = float(x[0]), float(x[-1])
    if not low_edge <= vertex <= high_edge:
        side = "below_grid" if vertex < low_edge else "above_grid"
        return {**base, "status": side, "lr_opt": float(lrs[window][0 if vertex < low_edge else -1]),
                "reason": "the fitted parabola's vertex lies outside the lrs it was fitted on"}
    draws = _bootstrap(x - centre, c2 * (x - centre) ** 2 + c1 * (x - centre) + c0, w, sigma)
    result = {**base, "status": "measured", "window": [float(lrs[window][0]), float(lrs[window][-1])],
              "window_lrs": int(len(x)), "ln_lr_opt": float(vertex), "lr_opt": math.exp(vertex),
              "loss_at_opt": float(c0 - c1 ** 2 / (4 * c2)), "curvature": float(c2), "sigma": sigma}
    if draws is None:
        return {**result, "var_ln": None, "ci": None, "clipped_share": None,
                "reason": "no seed SD to put an interval on the vertex"}
    draws = np.clip(draws + centre, low_edge, high_edge)
    clipped = float(np.mean((draws <= low_edge) | (draws >= high_edge)))
    tail = (1 - confidence) / 2
    q16, q84 = np.quantile(draws, [0.1587, 0.8413])
    return {**result, "var_ln": float(((q84 - q16) / 2) ** 2), "clipped_share": clipped,
            "ci": [math.exp(float(np.quantile(draws, tail))), math.exp(float(np.quantile(draws, 1 - tail)))]}


def _bootstrap(x: np.ndarray, fitted: np.ndarray, w: np.ndarray, sigma: Optional[float]) -> Optional[np.ndarray]:
    """Vertices of parabolas refitted to the fitted curve plus seed noise; a resample without a minimum inside
    the window counts as the window edge its slope points to (so the interval widens, never silently narrows)."""
    if not sigma:
        return None
    rng = np.random.default_rng(SEED)
    noisy = fitted[:, None] + rng.normal(0.0, 1.0, (len(x), BOOTSTRAP)) * (sigma / np.sqrt(w))[:, None]
    c2, c1, _ = _quadratic(x, noisy, w)
    with np.errstate(divide="ignore", invalid="ignore"):
        vertex = np.where(c2 > 0, -c1 / (2 * c2), np.where(c1 > 0, -np.inf, np.inf))
    return vertex


def lr_sensitivity(trials: list[dict], lr_opt: float, initial_loss: Optional[float], span: float = 2 ** 1.5
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
    return {"sensitivity": float(np.mean(np.minimum(means[inside], initial_loss) - best)),
            "lrs": int(inside.sum()), "range": [float(lrs[inside][0]), float(lrs[inside][-1])]}
