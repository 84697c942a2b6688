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


def _windows(n: int, best: int) -> list[slice]:
    """Every run of WINDOW consecutive lrs (or all of them, when fewer) that contains the minimum."""
    size = min(WINDOW, n)
    return [slice(start, start + size) for start in range(max(0, best - size + 1), min(best, n - size) + 1)]


def _local_fit(lrs: np.ndarray, means: np.ndarray, seeds: np.ndarray, best: int) -> Optional[dict]:
    """The quadratic in ln lr over the window centred on the minimum, or, when its vertex falls outside it, the
    nearest shifted window whose vertex lies inside: next to an instability cliff a centred window straddles the
    cliff, while the window on the smooth side locates the vertex. (A fixed order of preference, not the best-fitting
    window, so the choice does not chase the noise.) None when no window brackets a vertex."""
    centred = best - WINDOW // 2
    for window in sorted(_windows(len(lrs), best), key=lambda w: (abs(w.start - centred), w.start)):
        x, y, w = np.log(lrs[window]), means[window], seeds[window]
        centre = float(x.mean())
        c2, c1, c0 = _quadratic(x - centre, y, w)
        if c2 > 0 and x[0] <= centre - c1 / (2 * c2) <= x[-1]:
            return {"window": window, "x": x, "w": w, "centre": centre, "coef": (c2, c1, c0),
                    "fitted": c2 * (x - centre) ** 2 + c1 * (x - centre) + c0}
    return None


def cell_optimum(trials: list[dict], sigma: Optional[float], confidence: float = 0.95) -> dict:
    """lr_opt of one cell from its feasible trials. `status`: measured (an interior vertex with a CI), below_grid /
    above_grid (the minimum is on the grid's edge: a bound), no_vertex (no window of lrs around the minimum brackets
    a parabola's vertex: not locally quadratic), or too_few."""
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
    local = _local_fit(lrs, means, seeds, best)
    if local is None:
        return {**base, "status": "no_vertex", "lr_opt": float(lrs[best]),
                "reason": "no window of lrs around the minimum puts a parabola's vertex inside it"}
    (c2, c1, c0), x, centre = local["coef"], local["x"], local["centre"]
    vertex = centre - c1 / (2 * c2)
    window = local["window"]
    result = {**base, "status": "measured", "window": [float(lrs[window][0]), float(lrs[window][-1])],
              "window_lrs": int(len(x)), "ln_lr_opt": float(vertex), "lr_opt": math.exp(vertex),
              "loss_at_opt": float(c0 - c1 ** 2 / (4 * c2)), "curvature": float(c2), "sigma": sigma}
    sigma_eff = _with_lack_of_fit(sigma, means[window], local["fitted"], local["w"])
    result["birge_ratio"] = sigma_eff / sigma if sigma else None
    draws = _bootstrap(x - centre, local["fitted"], local["w"], sigma_eff)
    if draws is None:
        return {**result, "var_ln": None, "ci": None, "clipped_share": None,
                "reason": "no seed SD to put an interval on the vertex"}
    low_edge, high_edge = float(x[0]), float(x[-1])
    draws = np.clip(draws + centre, low_edge, high_edge)
    clipped = float(np.mean((draws <= low_edge) | (draws >= high_edge)))
    tail = (1 - confidence) / 2
    q16, q84 = np.quantile(draws, [0.1587, 0.8413])
    return {**result, "var_ln": float(np.var(draws)), "clipped_share": clipped,
            "ci": [math.exp(float(np.quantile(draws, tail))), math.exp(float(np.quantile(draws, 1 - tail)))]}


def _with_lack_of_fit(sigma: Optional[float], y: np.ndarray, fitted: np.ndarray, w: np.ndarray) -> Optional[float]:
    """The seed SD, scaled up by the Birge ratio sqrt(chi^2 / df) when the parabola misses its points by more than
    the seed noise explains (a curve that is not quadratic over the window, e.g. next to an instability cliff)."""
    if not sigma:
        return sigma
    df = len(y) - 3
    if df < 1:
        return sigma
    chi2 = float(np.sum(w * (y - fitted) ** 2)) / sigma ** 2
    return sigma * math.sqrt(max(1.0, chi2 / df))


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
