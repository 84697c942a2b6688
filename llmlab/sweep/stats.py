"""The lab's statistics: seed noise first, then effects estimated jointly by least squares and judged against it.

A Latin hypercube is not orthogonal, so a factor's marginal level means also carry the other factors' effects.
Fitting all main effects together (statsmodels OLS, sum-to-zero contrasts: each level's effect is its deviation
from the grand mean) separates them. Their standard errors use the *pure error* -- the spread between seed
replicates of the same configuration -- when replicates exist, because the residual of a 20-run main-effects fit
also holds every interaction it leaves out. Each effect is then `resolved` (its 95 % CI excludes 0) or
`within noise`.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Optional

import numpy as np

CONFIDENCE = 0.95
POWER = 0.80
TARGET_EFFECT = 0.05  # nats: the smallest final-loss difference the report asks how to resolve


def _ok(rows: list[dict], metric: str) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok" and _finite(r.get(metric))]


def _finite(value) -> bool:
    try:
        return value is not None and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def pure_error(rows: list[dict], metric: str) -> dict:
    """Pooled standard deviation between seed replicates of the same design point, with its degrees of freedom
    and a chi-square 95 % interval: the lab's noise floor for `metric`."""
    from scipy import stats

    groups: dict[str, list[float]] = {}
    for row in _ok(rows, metric):
        groups.setdefault(str(row.get("point", row["trial_id"])), []).append(float(row[metric]))
    replicated = [np.array(v) for v in groups.values() if len(v) >= 2]
    df = sum(len(v) - 1 for v in replicated)
    if df == 0:
        return {"sd": None, "df": 0, "ci": (None, None), "groups": 0, "runs": 0}
    sd = math.sqrt(sum(float(((v - v.mean()) ** 2).sum()) for v in replicated) / df)
    tail = (1 - CONFIDENCE) / 2
    ci = (sd * math.sqrt(df / stats.chi2.ppf(1 - tail, df)), sd * math.sqrt(df / stats.chi2.ppf(tail, df)))
    return {"sd": sd, "df": df, "ci": ci, "groups": len(replicated), "runs": sum(len(v) for v in replicated)}


def replicates_needed(sd: Optional[float], effect: float = TARGET_EFFECT) -> Optional[int]:
    """Runs per configuration for a two-configuration comparison to detect `effect` at 95 % confidence with
    80 % power: n = 2 ((z_0.975 + z_0.80) sd / effect)^2 (normal approximation)."""
    from scipy import stats

    if sd is None:
        return None
    z = stats.norm.ppf(1 - (1 - CONFIDENCE) / 2) + stats.norm.ppf(POWER)
    return max(2, math.ceil(2 * (z * sd / effect) ** 2))


def _frame(rows: list[dict], metric: str, factors: list[str]):
    import pandas as pd

    ok = _ok(rows, metric)
    frame = pd.DataFrame({"y": [float(r[metric]) for r in ok],
                          **{f: [str(r.get(f)) for r in ok] for f in factors}})
    usable = [f for f in factors if frame[f].nunique() > 1]
    return frame, usable


def _level_contrasts(fit, factor: str, levels: list[str]) -> list[tuple[str, np.ndarray]]:
    """Sum coding keeps k-1 coefficients per factor; the last level's effect is minus their sum."""
    names = list(fit.params.index)
    rows = []
    coded = [names.index(f"C({factor}, Sum)[S.{level}]") for level in levels[:-1]]
    for level, index in zip(levels[:-1], coded):
        vector = np.zeros(len(names))
        vector[index] = 1.0
        rows.append((level, vector))
    last = np.zeros(len(names))
    last[coded] = -1.0
    rows.append((levels[-1], last))
    return rows


def fit_main_effects(rows: list[dict], factors: list[str], metric: str = "final_loss",
                     order: Optional[dict[str, list]] = None) -> dict:
    """Least-squares main effects of every varying factor on `metric`, each level with a 95 % CI.

    Noise: the replicate pure error when there is one, else the fit's residual (marked so)."""
    import pandas as pd
    import statsmodels.formula.api as smf
    from scipy import stats

    frame, usable = _frame(rows, metric, factors)
    n_params = 1 + sum(frame[f].nunique() - 1 for f in usable)
    if not usable or len(frame) <= n_params - 1:
        return {"effects": [], "noise": None, "n": len(frame), "params": n_params, "factors": usable}
    levels = {f: sorted(frame[f].unique(), key=lambda v: _order_key(f, v, order)) for f in usable}
    formula = "y ~ " + " + ".join(f"C({f}, Sum)" for f in usable)
    with warnings.catch_warnings():  # a saturated fit warns about a zero residual; handled below
        warnings.simplefilter("ignore")
        typed = frame.assign(**{f: frame[f].astype(pd.CategoricalDtype(levels[f])) for f in usable})
        fit = smf.ols(formula, data=typed).fit()
    noise = pure_error(rows, metric)
    if noise["sd"] is not None:
        sigma, df, source = noise["sd"], noise["df"], "replicates (pure error)"
    elif fit.df_resid > 0:
        sigma, df, source = math.sqrt(fit.ssr / fit.df_resid), int(fit.df_resid), "fit residual (no replicates)"
    else:
        sigma, df, source = None, 0, "none (no replicates, saturated fit)"
    t = stats.t.ppf(1 - (1 - CONFIDENCE) / 2, df) if df else None
    effects = []
    for factor in usable:
        for level, vector in _level_contrasts(fit, factor, levels[factor]):
            effect = float(vector @ fit.params.values)
            se = (sigma * math.sqrt(float(vector @ fit.normalized_cov_params.values @ vector))
                  if sigma is not None else None)
            low, high = (effect - t * se, effect + t * se) if se is not None else (None, None)
            effects.append({"factor": factor, "level": level, "n": int((frame[factor] == level).sum()),
                            "effect": effect, "se": se, "ci_low": low, "ci_high": high,
                            "verdict": _verdict(low, high)})
    return {"effects": effects, "noise": {"sd": sigma, "df": df, "source": source}, "n": len(frame),
            "params": n_params, "factors": usable, "fit": fit, "frame": frame, "levels": levels}


def factor_tests(fitted: dict) -> list[dict]:
    """Does a factor matter at all? Its type II sum of squares over the noise variance, an F test per factor
    (statsmodels anova_lm for the sums of squares; the denominator is the pure error when there is one)."""
    from scipy import stats as sps
    from statsmodels.stats.anova import anova_lm

    noise = fitted.get("noise") or {}
    if not fitted.get("fit") or not noise.get("sd") or not noise.get("df"):
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = anova_lm(fitted["fit"], typ=2)
    found = []
    for name, row in table.drop(index="Residual").iterrows():
        f_value = (row["sum_sq"] / row["df"]) / noise["sd"] ** 2
        p_value = float(sps.f.sf(f_value, row["df"], noise["df"]))
        found.append({"factor": name.split("(")[1].split(",")[0], "df": int(row["df"]), "F": float(f_value),
                      "p_value": p_value, "verdict": "resolved" if p_value < 1 - CONFIDENCE else "within noise"})
    return found


def _verdict(low, high) -> str:
    if low is None:
        return "no noise estimate"
    return "resolved" if low > 0 or high < 0 else "within noise"


def _order_key(factor: str, value: str, order: Optional[dict[str, list]]) -> tuple:
    known = [str(v) for v in (order or {}).get(factor, [])]
    if value in known:
        return (0, known.index(value), "")
    try:
        return (1, float(value), "")
    except ValueError:
        return (2, 0.0, value)


def level_difference(fitted: dict, factor: str, a: str, b: str) -> dict:
    """Effect of level `a` minus level `b` of one factor, from the joint fit, with its 95 % CI and verdict."""
    from scipy import stats as sps

    contrasts = dict(_level_contrasts(fitted["fit"], factor, fitted["levels"][factor]))
    vector = contrasts[a] - contrasts[b]
    noise = fitted["noise"]
    effect = float(vector @ fitted["fit"].params.values)
    if not noise["sd"] or not noise["df"]:
        return {"difference": effect, "ci_low": None, "ci_high": None, "verdict": "no noise estimate"}
    half = sps.t.ppf(1 - (1 - CONFIDENCE) / 2, noise["df"]) * noise["sd"] * math.sqrt(
        float(vector @ fitted["fit"].normalized_cov_params.values @ vector))
    return {"difference": effect, "ci_low": effect - half, "ci_high": effect + half,
            "verdict": _verdict(effect - half, effect + half)}


def minimum_resolvable_effect(fitted: dict) -> Optional[float]:
    """Median over level effects of the smallest effect whose 95 % CI would exclude zero in this design."""
    half_widths = [e["ci_high"] - e["effect"] for e in fitted["effects"] if e["ci_high"] is not None]
    return float(np.median(half_widths)) if half_widths else None


def interaction_tests(fitted: dict, limit: int = 3) -> list[dict]:
    """Each two-factor interaction added alone to the main-effects fit, tested by a nested F test (anova_lm).
    A 20-run design cannot hold them all at once; read these as hints of which pair to study next."""
    import itertools

    import statsmodels.formula.api as smf
    from statsmodels.stats.anova import anova_lm

    if not fitted.get("fit") or len(fitted["factors"]) < 2:
        return []
    base, frame = fitted["fit"], fitted["fit"].model.data.frame
    found = []
    for a, b in itertools.combinations(fitted["factors"], 2):
        extra = (frame[a].nunique() - 1) * (frame[b].nunique() - 1)
        if base.df_resid - extra < 1:
            continue
        formula = base.model.formula + f" + C({a}, Sum):C({b}, Sum)"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bigger = smf.ols(formula, data=frame).fit()
            table = anova_lm(base, bigger)
        f_value, p_value = table["F"].iloc[1], table["Pr(>F)"].iloc[1]
        if _finite(p_value):
            found.append({"factors": f"{a} x {b}", "df": int(table["df_diff"].iloc[1]), "F": float(f_value),
                          "p_value": float(p_value)})
    return sorted(found, key=lambda x: x["p_value"])[:limit]


def variance_shares(rows: list[dict], factors: list[str], metrics: list[str],
                    order: Optional[dict[str, list]] = None) -> dict[str, dict[str, float]]:
    """metric -> {factor: share of the total sum of squares (type II ANOVA), 'residual': the rest}."""
    from statsmodels.stats.anova import anova_lm

    shares: dict[str, dict[str, float]] = {}
    for metric in metrics:
        fitted = fit_main_effects(rows, factors, metric, order)
        if not fitted.get("fit") or fitted["fit"].df_resid < 1:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            table = anova_lm(fitted["fit"], typ=2)
        total = float(table["sum_sq"].sum())
        if not total > 0:
            continue
        shares[metric] = {("residual" if name == "Residual" else name.split("(")[1].split(",")[0]):
                          float(value) / total for name, value in table["sum_sq"].items()}
    return shares


def compare_to_reference(values: list[float], reference: list[float], sd: Optional[float], df: int) -> dict[str, Any]:
    """Mean difference of a design point from the reference with a 95 % CI from the pooled seed noise."""
    from scipy import stats

    delta = float(np.mean(values) - np.mean(reference))
    if sd is None or not df:
        return {"delta": delta, "ci_low": None, "ci_high": None, "resolved": False}
    half = stats.t.ppf(1 - (1 - CONFIDENCE) / 2, df) * sd * math.sqrt(1 / len(values) + 1 / len(reference))
    return {"delta": delta, "ci_low": delta - half, "ci_high": delta + half,
            "resolved": delta + half < 0 or delta - half > 0}
