"""How the optimal lr moves with training length: ln lr_opt = a + beta ln D on one probe, and what that does to a
target's lr.

The fit is the law across sizes' own estimator (llmlab.scaling.law: WLS with each optimum's variance, Paule-Mandel
lack of fit, Knapp-Hartung t intervals) with the training tokens D of each length's cell in place of N. Under muP the
lr optimum does not move with width (the lab's decided result), so a length law measured at the base width composes
with the width scan: the target's lr is the width scan's lr at its own D0, moved by beta ln(D / D0).
"""

from __future__ import annotations

import math

from scipy import stats

from llmlab.core.errors import UserError
from llmlab.scaling.law import fit_law


def fit_length_law(points: list[dict], confidence: float = 0.95) -> dict:
    """`points`: one measured optimum per training length ({"size": label, "tokens": D, "ln_lr_opt", "var_ln"})."""
    law = fit_law(
        [{**p, "n_params": float(p["tokens"]), "batch_size": 1.0} for p in points],
        with_batch=False,
        confidence=confidence,
    )
    if law["status"] != "ok":
        return {**law, "reason": law["reason"].replace("sizes", "lengths")}
    return {
        **{k: v for k, v in law.items() if not k.startswith("alpha") and k not in ("n_range", "sizes")},
        "formula": "ln lr_opt = a + beta ln D",
        "names": ["a", "beta"],
        "a": law["k0"],
        "beta": law["alpha"],
        "beta_ci": law["alpha_ci"],
        "lengths": law["sizes"],
        "d_range": law["n_range"],
    }


def length_shift(law: dict, d_from: float, d_to: float) -> dict:
    """beta ln(d_to / d_from) in ln lr, with its standard error and df: the slope's uncertainty times the distance,
    plus the law's lack of fit (the target length's own scatter about the line)."""
    if law.get("status") != "ok":
        raise UserError(f"the length law is not usable: {law.get('reason', 'not fitted')}; finish its scan first")
    distance = math.log(d_to / d_from)
    se_beta = math.sqrt(float(law["cov"][1][1]))
    return {
        "ln_shift": law["beta"] * distance,
        "factor": math.exp(law["beta"] * distance),
        "se": math.sqrt((distance * se_beta) ** 2 + float(law["tau2"])),
        "df": int(law["df"]),
        "tokens_ratio": d_to / d_from,
    }


def combine(ln_lr: float, se_lr: float, df_lr, shift: dict, confidence: float) -> dict:
    """ln lr + the shift, with a t interval on the smaller df of the two independent parts (`df_lr` None: normal).
    Conservative on purpose: Welch-Satterthwaite's df can exceed the width forecast's own, so a small shift would
    narrow the interval; on the smaller df, adding the length law's uncertainty never does."""
    variance = se_lr**2 + shift["se"] ** 2
    df = min(df_lr if df_lr else math.inf, shift["df"])
    t = stats.t.ppf((1 + confidence) / 2, df) if math.isfinite(df) else stats.norm.ppf((1 + confidence) / 2)
    centre = ln_lr + shift["ln_shift"]
    half = t * math.sqrt(variance)
    return {"lr": math.exp(centre), "interval": [math.exp(centre - half), math.exp(centre + half)], "df": df}
