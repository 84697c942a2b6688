"""The lab's statistics: seed noise first, then effects as contrasts against a named reference, judged with
multiplicity control.

- Effects are treatment contrasts: each level minus the factor's reference level (the control's), fitted jointly
  by least squares (statsmodels OLS), because a Latin hypercube is not orthogonal and marginal level means would
  mix the factors.
- The error term of the main effects is the fit's residual (pure error + everything the main-effects model leaves
  out), with its df; the pure error of the replicates alone is reported beside it, with a lack-of-fit test.
- Every family of tests in a report (level contrasts, factor F tests, interactions, design points against the
  reference) is Holm-corrected (statsmodels multipletests); `resolved` means the Holm-adjusted p < 0.05.
- Power: the minimum detectable effect at 80 % power, and replicate counts, use t with the SD's df.
"""

from __future__ import annotations

import gc
import itertools
import math
import warnings
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import numpy as np
import pandas as pd
import statsmodels.formula.api as smf
from scipy import stats as sps
from statsmodels.stats.anova import anova_lm
from statsmodels.stats.multitest import multipletests

CONFIDENCE = 0.95
ALPHA = 1 - CONFIDENCE
POWER = 0.80
TARGET_EFFECT = 0.05  # nats: the smallest final-loss difference the report asks how to resolve


def is_finite(value) -> bool:
    try:
        return value is not None and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _ok(rows: list[dict], metric: str) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok" and is_finite(r.get(metric))]


@contextmanager
def _no_forced_gc() -> Iterator[None]:
    # statsmodels' Holm branch calls gc.collect() on every call: a full collection, 0.56 s in a process that holds
    # torch and transformers (measured), which made it most of an effects fit's time. Nothing here needs one.
    collect = gc.collect
    gc.collect = lambda *args, **kwargs: 0
    try:
        yield
    finally:
        gc.collect = collect


def holm(p_values: list[float]) -> list[float]:
    """Holm-adjusted p-values of one family (statsmodels)."""
    if not p_values:
        return []
    with _no_forced_gc():
        adjusted = multipletests(p_values, alpha=ALPHA, method="holm")[1]
    return [float(p) for p in adjusted]


def sd_interval(sd: float, df: int) -> tuple[float, float]:
    """Chi-square 95 % interval of a standard deviation estimated on df degrees of freedom."""
    tail = ALPHA / 2
    return sd * math.sqrt(df / sps.chi2.ppf(1 - tail, df)), sd * math.sqrt(df / sps.chi2.ppf(tail, df))


def pure_error(rows: list[dict], metric: str) -> dict:
    """Pooled SD between seed replicates of the same design point, its df and 95 % interval: the noise floor."""
    groups: dict[tuple, list[float]] = {}
    for row in _ok(rows, metric):  # replicates on different machines are not replicates of each other
        groups.setdefault((str(row.get("point", row["trial_id"])), machine_of(row)), []).append(float(row[metric]))
    replicated = [np.array(v) for v in groups.values() if len(v) >= 2]
    df = sum(len(v) - 1 for v in replicated)
    if df == 0:
        return {"sd": None, "df": 0, "ci": (None, None), "groups": 0, "runs": 0}
    sd = math.sqrt(sum(float(((v - v.mean()) ** 2).sum()) for v in replicated) / df)
    return {
        "sd": sd,
        "df": df,
        "ci": sd_interval(sd, df),
        "groups": len(replicated),
        "runs": sum(len(v) for v in replicated),
    }


def replicates_needed(sd: Optional[float], df: int, effect: float = TARGET_EFFECT) -> Optional[int]:
    """Runs per configuration for a two-configuration comparison to detect `effect` at 5 % (two-sided) with 80 %
    power, with t quantiles on the df the SD was estimated with: n = 2 ((t_0.975 + t_0.80) sd / effect)^2."""
    if sd is None or not df:
        return None
    t = sps.t.ppf(1 - ALPHA / 2, df) + sps.t.ppf(POWER, df)
    return max(2, math.ceil(2 * (t * sd / effect) ** 2))


def detectable(se: float, df: int) -> float:
    """The effect a test with this SE and df detects with 80 % power at 5 % two-sided."""
    return (sps.t.ppf(1 - ALPHA / 2, df) + sps.t.ppf(POWER, df)) * se


def machine_of(row: dict) -> str:
    """The CPU a run recorded (llmlab.core.runinfo.machine_label); '' for runs from before it was recorded."""
    value = row.get("cpu")
    return "" if value in (None, "", "None") or (isinstance(value, float) and math.isnan(value)) else str(value)


def _frame(rows: list[dict], metric: str, factors: list[str]) -> tuple[pd.DataFrame, list[str]]:
    ok = _ok(rows, metric)
    frame = pd.DataFrame(
        {
            "y": [float(r[metric]) for r in ok],
            **{f: [str(r.get(f)) for r in ok] for f in factors},
            "machine": [machine_of(r) for r in ok],
        }
    )
    return frame, [f for f in factors if frame[f].nunique() > 1]


def _machine_block(frame: pd.DataFrame) -> tuple[str, Optional[str]]:
    """A fixed machine effect when the runs come from several CPUs (never pooled without one): the formula term and
    the reference machine (the one with most runs), or no term."""
    if frame["machine"].nunique() < 2:
        return "", None
    reference = frame["machine"].value_counts().index[0]
    return f" + C(machine, Treatment(reference={reference!r}))", reference


def _order_key(factor: str, value: str, order: Optional[dict[str, list]]) -> tuple:
    known = [str(v) for v in (order or {}).get(factor, [])]
    if value in known:
        return (0, known.index(value), "")
    try:
        return (1, float(value), "")
    except ValueError:
        return (2, 0.0, value)


def _term(factor: str, reference: str) -> str:
    return f"C({factor}, Treatment(reference={reference!r}))"


def fit_effects(
    rows: list[dict],
    factors: list[str],
    reference: dict[str, Any],
    metric: str = "final_loss",
    order: Optional[dict[str, list]] = None,
) -> dict:
    """Least-squares treatment contrasts (level - reference level) of every varying factor on `metric`, with
    95 % CIs on the residual's df, raw and Holm-adjusted p-values across all contrasts."""
    # long: 76 lines once ruff's layout puts its long calls one argument a line; one step, read top to bottom
    frame, usable = _frame(rows, metric, factors)
    refs = {f: str(reference.get(f)) for f in usable}
    usable = [f for f in usable if refs[f] in set(frame[f])]  # a reference level that never ran cannot anchor
    block, machine_ref = _machine_block(frame)
    n_params = 1 + sum(frame[f].nunique() - 1 for f in usable) + (frame["machine"].nunique() - 1 if block else 0)
    empty = {
        "contrasts": [],
        "noise": None,
        "n": len(frame),
        "params": n_params,
        "factors": usable,
        "reference": refs,
        "metric": metric,
    }
    if not usable or len(frame) <= n_params:
        return empty
    levels = {f: sorted(frame[f].unique(), key=lambda v: _order_key(f, v, order)) for f in usable}
    typed = frame.assign(**{f: frame[f].astype(pd.CategoricalDtype(levels[f])) for f in usable})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = smf.ols("y ~ " + " + ".join(_term(f, refs[f]) for f in usable) + block, data=typed).fit()
    df = int(fit.df_resid)
    sigma = math.sqrt(fit.ssr / df)
    if not sigma > 0:  # a fit with no residual has no noise estimate: nothing to judge effects against
        return empty
    t = sps.t.ppf(1 - ALPHA / 2, df)
    contrasts = []
    for factor in usable:
        for level in levels[factor]:
            if level == refs[factor]:
                continue
            name = f"{_term(factor, refs[factor])}[T.{level}]"
            effect, se = float(fit.params[name]), float(fit.bse[name])
            contrasts.append(
                {
                    "factor": factor,
                    "level": level,
                    "reference": refs[factor],
                    "n": int((frame[factor] == level).sum()),
                    "effect": effect,
                    "se": se,
                    "ci_low": effect - t * se,
                    "ci_high": effect + t * se,
                    "df": df,
                    "p_value": float(2 * sps.t.sf(abs(effect / se), df)),
                    "mde_80": detectable(se, df),
                }
            )
    for contrast, adjusted in zip(contrasts, holm([c["p_value"] for c in contrasts])):
        contrast.update(p_holm=adjusted, verdict="resolved" if adjusted < ALPHA else "within noise")
    noise = {
        "sd": sigma,
        "df": df,
        "source": "residual of the main-effects fit (pure error + lack of fit)"
        + (", with a fixed machine effect" if block else ""),
        "pure_error": pure_error(rows, metric),
        "machines": _machine_effects(fit, frame, machine_ref, t) if block else None,
    }
    return {
        **empty,
        "contrasts": contrasts,
        "noise": noise,
        "fit": fit,
        "frame": typed,
        "levels": levels,
        "lack_of_fit": lack_of_fit(fit, noise["pure_error"]),
    }


def _machine_effects(fit, frame: pd.DataFrame, reference: str, t: float) -> list[dict]:
    """Each other machine minus the reference machine, at equal settings (a nuisance term: no Holm family)."""
    effects = []
    for machine in sorted(set(frame["machine"]) - {reference}):
        name = f"C(machine, Treatment(reference={reference!r}))[T.{machine}]"
        effect, se = float(fit.params[name]), float(fit.bse[name])
        effects.append(
            {
                "machine": machine or "not recorded",
                "reference": reference or "not recorded",
                "runs": int((frame["machine"] == machine).sum()),
                "effect": effect,
                "ci": [effect - t * se, effect + t * se],
                "p_value": float(2 * sps.t.sf(abs(effect / se), fit.df_resid)),
            }
        )
    return effects


def lack_of_fit(fit, pure: dict) -> Optional[dict]:
    """F test of the main-effects model's lack of fit against the replicates' pure error."""
    if not pure["sd"] or fit.df_resid <= pure["df"]:
        return None
    ss_pe = pure["sd"] ** 2 * pure["df"]
    df_lof = int(fit.df_resid) - pure["df"]
    f_value = ((fit.ssr - ss_pe) / df_lof) / pure["sd"] ** 2
    return {"F": float(f_value), "df": [df_lof, pure["df"]], "p_value": float(sps.f.sf(f_value, df_lof, pure["df"]))}


def factor_tests(fitted: dict) -> list[dict]:
    """Does a factor matter at all? F test of its type II sum of squares against the residual, Holm across factors."""
    if not fitted.get("fit"):
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = anova_lm(fitted["fit"], typ=2).drop(index="Residual")
    found = [
        {
            "factor": name.split("(")[1].split(",")[0],
            "df": int(row["df"]),
            "F": float(row["F"]),
            "p_value": float(row["PR(>F)"]),
        }
        for name, row in table.iterrows()
        if not name.startswith("C(machine")
    ]  # a nuisance block, not a factor of the design
    for test, adjusted in zip(found, holm([t["p_value"] for t in found])):
        test.update(p_holm=adjusted, verdict="resolved" if adjusted < ALPHA else "within noise")
    return found


def level_difference(fitted: dict, factor: str, a: str, b: str) -> dict:
    """Level `a` minus level `b` of one factor from the joint fit, with its 95 % CI (one test, uncorrected)."""
    fit, ref = fitted["fit"], fitted["reference"][factor]

    def vector(level: str) -> np.ndarray:
        out = np.zeros(len(fit.params))
        if level != ref:
            out[list(fit.params.index).index(f"{_term(factor, ref)}[T.{level}]")] = 1.0
        return out

    contrast = vector(a) - vector(b)
    effect = float(contrast @ fit.params.values)
    se = math.sqrt(float(contrast @ fit.cov_params().values @ contrast))
    half = sps.t.ppf(1 - ALPHA / 2, fit.df_resid) * se
    p_value = float(2 * sps.t.sf(abs(effect) / se, fit.df_resid)) if se > 0 else 1.0
    return {
        "difference": effect,
        "ci_low": effect - half,
        "ci_high": effect + half,
        "p_value": p_value,
        "df": int(fit.df_resid),
        "verdict": "resolved" if p_value < ALPHA else "within noise",
    }


def minimum_detectable_effect(fitted: dict) -> Optional[float]:
    """Median over the level contrasts of the effect found with 80 % power at 5 % (unadjusted)."""
    values = [c["mde_80"] for c in fitted["contrasts"]]
    return float(np.median(values)) if values else None


def interaction_tests(fitted: dict) -> list[dict]:
    """Every two-factor interaction, one family. A screening design cannot hold all pairs' df in one model, so each
    pair's extra sum of squares is taken from the main-effects model plus that pair; every F uses the same
    denominator, the replicates' pure error (the one error free of interactions), and the family is Holm-corrected."""
    if not fitted.get("fit") or len(fitted["factors"]) < 2:
        return []
    base, frame, refs = fitted["fit"], fitted["frame"], fitted["reference"]
    pure = fitted["noise"]["pure_error"]
    if not pure["sd"]:
        return []
    found = []
    for a, b in itertools.combinations(fitted["factors"], 2):
        extra = (frame[a].nunique() - 1) * (frame[b].nunique() - 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bigger = smf.ols(base.model.formula + f" + {_term(a, refs[a])}:{_term(b, refs[b])}", data=frame).fit()
        gained = int(round(base.df_resid - bigger.df_resid))  # estimable interaction df (aliasing drops some)
        if gained < 1 or bigger.df_resid < 0:
            continue
        f_value = ((base.ssr - bigger.ssr) / gained) / pure["sd"] ** 2
        found.append(
            {
                "factors": f"{a} x {b}",
                "df": [gained, pure["df"]],
                "of_df": extra,
                "F": float(f_value),
                "p_value": float(sps.f.sf(f_value, gained, pure["df"])),
            }
        )
    for test, adjusted in zip(found, holm([t["p_value"] for t in found])):
        test.update(p_holm=adjusted, verdict="resolved" if adjusted < ALPHA else "within noise")
    return sorted(found, key=lambda t: t["p_value"])


def variance_shares(
    rows: list[dict],
    factors: list[str],
    metrics: list[str],
    reference: dict[str, Any],
    order: Optional[dict[str, list]] = None,
) -> dict[str, dict[str, float]]:
    """metric -> {factor: type II SS / total SS, 'residual': residual SS / total SS, 'shared': the rest}. In a
    non-orthogonal design the type II sums do not add up to the total: `shared` is what no factor owns alone."""
    shares: dict[str, dict[str, float]] = {}
    for metric in metrics:
        fitted = fit_effects(rows, factors, reference, metric, order)
        if not fitted.get("fit") or fitted["fit"].df_resid < 1:
            continue
        total = float(fitted["fit"].centered_tss)
        if not total > 0:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            table = anova_lm(fitted["fit"], typ=2)
        share = {
            ("residual" if name == "Residual" else name.split("(")[1].split(",")[0]): float(value) / total
            for name, value in table["sum_sq"].items()
        }
        share["shared"] = 1.0 - sum(share.values())
        shares[metric] = share
    return shares


def compare_to_reference(values: list[float], reference: list[float], sd: Optional[float], df: int) -> dict[str, Any]:
    """Mean difference of a design point from the reference with a 95 % CI and p-value from the seed noise."""
    delta = float(np.mean(values) - np.mean(reference))
    if sd is None or not df:
        return {"delta": delta, "ci_low": None, "ci_high": None, "p_value": None}
    se = sd * math.sqrt(1 / len(values) + 1 / len(reference))
    half = sps.t.ppf(1 - ALPHA / 2, df) * se
    return {
        "delta": delta,
        "ci_low": delta - half,
        "ci_high": delta + half,
        "p_value": float(2 * sps.t.sf(abs(delta) / se, df)),
    }
