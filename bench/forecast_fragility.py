"""How fragile is a registered verdict? The first forecast's `failed`, re-judged under fair alternative analyses.

From the scan's shipped trials (scaling_fits.json) and its preregistration.json, with the registered forecast and
its SE held fixed, the held-out optimum is re-estimated:
- as registered (the machines pooled), and with the machine term;
- on each machine's registered trials alone;
- leaving out each registered seed block in turn;
- as the vertex of one quadratic over all the held-out lrs (instead of the mean of the 5-lr windows);
- as the bootstrap's centre (the estimator on its smooth curve) instead of the raw vertex;
and the registered forecasts of the lab (first, SP, muP) are Holm-corrected as one family (two-sided t tests of ln R =
0 on each verdict's own SE and df). Each alternative keeps the registered verdict rule (llmlab.scaling.transfer.decide)
and, where the analysis does not give one, the registered analysis's SE. Writes a JSON the findings render:

    python bench/forecast_fragility.py --output docs/findings/lr-forecast/fragility.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
FINDINGS = REPO / "docs" / "findings"


def load(name: str) -> tuple[list[dict], dict, dict]:
    fits = json.loads((FINDINGS / name / "scaling_fits.json").read_text())
    feasible = set(fits["feasible_ids"])
    rows = [t for t in fits["trials"] if t["trial_id"] in feasible]
    from llmlab.scaling.scan import read_preregistration

    return rows, read_preregistration(FINDINGS / name), fits


def verdict_row(label: str, ln_r: float, se: float, df: int, note: str = "") -> dict:
    from llmlab.scaling.transfer import decide

    return {"analysis": label, **decide(ln_r, se, df), "note": note}


def judged(rows: list[dict], registration: dict, label: str, note: str = "") -> dict:
    """The held-out verdict of `rows` as analyse_sizes gives it (one machine: no machine term), the registered
    forecast judged; every registered trial present or not (a left-out block is the point)."""
    from llmlab.scaling.transfer import analyse_sizes

    design = {**registration["design"], "held_out_lrs": []}  # no "wait for every registered trial" here
    verdict = analyse_sizes(rows, registration={**registration, "design": design})["holdout"]
    verdict = verdict.get("as_registered") or verdict
    row = verdict["rows"][0]
    if "ratio" not in row:
        return {"analysis": label, "verdict": row["verdict"], "note": row.get("reason", note)}
    return {"analysis": label, **{k: row[k] for k in ("verdict", "ratio", "ci90", "ci95", "se_ln", "df")}, "note": note}


def held_out_alternatives(rows: list[dict], registration: dict, registered: dict) -> list[dict]:
    """A quadratic over all the held-out lrs, and the bootstrap's centre, each judged at the registered SE."""
    from llmlab.scaling.optimum import _quadratic, _smooth_curve, lr_table, seed_counts, window_vertices
    from llmlab.scaling.transfer import registered_rows, seed_noise, sigma_model

    size = registration["held_out"]
    held = [r for r in registered_rows(rows, registration) if str(r["size"]) == size]
    lrs, losses = lr_table(held)
    x, means, seeds = np.log(lrs), np.array([np.mean(v) for v in losses]), seed_counts(held, lrs)
    sigma = sigma_model(seed_noise(held), size)  # a number, or a function of lr where the noise grows with it
    sigmas = np.asarray(sigma(lrs) if callable(sigma) else np.full(len(lrs), sigma), dtype=float)
    c2, c1, _ = _quadratic(x - x.mean(), means, seeds / sigmas**2)
    quadratic = float(x.mean() - c1 / (2 * c2))
    estimate, _, brackets = window_vertices(x, means[:, None], seeds)
    used = np.flatnonzero(brackets[:, 0])
    span = slice(int(used[0]), int(used[-1]) + 5)
    truth, _, _ = _smooth_curve(x, means, seeds, sigmas, span)
    centre = float(window_vertices(x, truth[:, None], seeds)[0][0])
    forecast = registration["forecast"]["law"]["ln_lr"]
    se, df = registered["se_ln"], registered["df"]
    return [
        verdict_row(
            f"one quadratic over all {len(lrs)} held-out lrs", forecast - quadratic, se, df, "at the registered SE"
        ),
        verdict_row(
            "the bootstrap's centre (the estimator on its smooth curve)",
            forecast - centre,
            se,
            df,
            "at the registered SE",
        ),  # fmt: skip
    ]


def holm_family() -> list[dict]:
    """The three registered forecasts as one family: each verdict's two-sided p of ln R = 0, Holm-adjusted."""
    from scipy import stats
    from statsmodels.stats.multitest import multipletests

    family = []
    for name in ("lr-forecast", "lr-forecast-sp", "lr-forecast-mup"):
        holdout = json.loads((FINDINGS / name / "scaling_fits.json").read_text())["transfer"]["holdout"]
        row = (holdout.get("as_registered") or holdout)["rows"][0]
        t = math.log(row["ratio"]) / row["se_ln"]
        family.append({"scan": name, "ratio": row["ratio"], "p": float(2 * stats.t.sf(abs(t), row["df"]))})
    adjusted = multipletests([f["p"] for f in family], method="holm")[1]
    return [{**f, "p_holm": float(p)} for f, p in zip(family, adjusted)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scan", default="lr-forecast", help="the scan folder under docs/findings")
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    from llmlab.scaling.machines import machine_of
    from llmlab.scaling.transfer import registered_rows

    rows, registration, fits = load(args.scan)
    holdout = fits["transfer"]["holdout"]
    registered = (holdout.get("as_registered") or holdout)["rows"][0]
    analyses = [judged(rows, registration, "as registered (the machines pooled)")]
    blocked = holdout["rows"][0]
    analyses.append({"analysis": "with a machine term", **{k: blocked[k] for k in ("verdict", "ratio", "ci90", "ci95",
                     "se_ln", "df")}, "note": "the declared deviation"})  # fmt: skip
    held, size = registered_rows(rows, registration), registration["held_out"]
    fit_rows = [r for r in held if str(r["size"]) != size]
    for machine in sorted({machine_of(r) for r in held if str(r["size"]) == size}):
        mine = [r for r in held if str(r["size"]) == size and machine_of(r) == machine]
        analyses.append(judged(fit_rows + mine, registration, f"held-out trials of {machine} alone",
                               f"{len(mine)} trials"))  # fmt: skip
    seeds = int(registration["design"]["held_out_seeds"])
    for left_out in range(seeds):
        kept = [r for r in held if str(r["size"]) != size or int(r.get("replicate") or 0) != left_out]
        analyses.append(judged(kept, registration, f"without seed block r{left_out}"))
    analyses += held_out_alternatives(rows, registration, registered)
    result = {"scan": args.scan, "analyses": analyses, "holm": holm_family()}
    for row in analyses:
        ratio = f"R {row['ratio']:.2f} [{row['ci95'][0]:.2f}, {row['ci95'][1]:.2f}]" if "ratio" in row else ""
        print(f"{row['analysis']:<62} {row['verdict']:<12} {ratio}  {row.get('note', '')}")
    for row in result["holm"]:
        print(f"Holm: {row['scan']:<18} R {row['ratio']:.2f}  p {row['p']:.3g}  Holm p {row['p_holm']:.3g}")
    if args.output:
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
