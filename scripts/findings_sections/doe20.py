"""The doe20 screen on CPU: its summary, calibration, effects and claims (docs/findings/doe20-cpu)."""

from __future__ import annotations

from pathlib import Path

from findings_sections.common import FINDINGS, LABELS, REPO, interval, read_results, signed
from llmlab.sweep import stats
from llmlab.sweep.design import CONTROL, FACTORS
from llmlab.train.components import OPTIMIZERS, mean_lr_share

LION_LR_DIVISOR = OPTIMIZERS["lion"].lr_divisor


def doe20(folder: Path = FINDINGS / "doe20-cpu") -> dict:
    """The doe20 numbers: noise floor, contrasts with Holm, factor tests, detectable effect."""
    rows = read_results(folder)
    fitted = stats.fit_effects(rows, list(FACTORS), CONTROL, "final_loss", {k: list(v) for k, v in FACTORS.items()})
    floor = stats.pure_error(rows, "final_loss")
    control = [r["final_loss"] for r in rows if r["point"] == "control" and r["status"] == "ok"]
    return {
        "rows": rows,
        "fitted": fitted,
        "floor": floor,
        "control": control,
        "tests": stats.factor_tests(fitted),
        "mde": stats.minimum_detectable_effect(fitted),
        "needed": stats.replicates_needed(floor["sd"], floor["df"]),
    }


def contrast_text(c: dict) -> str:
    level = LABELS.get(c["level"], c["level"])
    reference = LABELS.get(c["reference"], c["reference"])
    return f"{level} − {reference} {signed(c['effect'])} {interval(c['ci_low'], c['ci_high'])}"


def doe20_summary(d: dict) -> str:
    floor, fitted = d["floor"], d["fitted"]
    resolved = [c for c in fitted["contrasts"] if c["verdict"] == "resolved"]
    quiet = [c for c in fitted["contrasts"] if c["factor"] in ("optimizer", "scheduler") and c["verdict"] != "resolved"]
    low, high = floor["ci"]
    return (
        f"What doe20 found at the cpu budget ({len(d['rows'])} runs, {len(d['control'])} of them the control with "
        f"seeds 42-{41 + len(d['control'])}): seed SD {floor['sd']:.4f} nats [{low:.4f}, {high:.4f}] on "
        f"{floor['df']} df. Contrasts against the control (AdamW, cosine), 95 % CIs, Holm over all "
        f"{len(fitted['contrasts'])}: resolved "
        + "; ".join(contrast_text(c) for c in resolved)
        + ("; within noise " + "; ".join(contrast_text(c) for c in quiet) if quiet else "")
        + f". Clip, warmup and weight decay are within noise at this budget. Lion runs at lr / {LION_LR_DIVISOR:g} and "
        f"polynomial spends {mean_lr_share('polynomial'):.2f} of the peak lr against "
        f"{mean_lr_share('cosine'):.2f} for cosine, so those contrasts carry an lr effect too."
    )


def doe20_calibration(d: dict) -> str:
    floor, fitted = d["floor"], d["fitted"]
    noise, lof = fitted["noise"], fitted["lack_of_fit"]
    low, high = floor["ci"]
    lines = [
        "| calibration | value |",
        "|---|---|",
        f"| control final loss ({len(d['control'])} seeds) | {sum(d['control']) / len(d['control']):.3f}, seed SD "
        f"**{floor['sd']:.4f}** [{low:.4f}, {high:.4f}] ({floor['df']} df, within machines; upper / SD = "
        f"{high / floor['sd']:.2f}, SD / lower = {floor['sd'] / low:.2f}) |",
        *(
            f"| machine term (fixed effect, not in any Holm family) | {m['machine']} − {m['reference']}: "
            f"{signed(m['effect'], 4)} {interval(*m['ci'], 4)} nats ({m['runs']} runs, p = {m['p_value']:.2g}) |"
            for m in noise.get("machines") or []
        ),
        f"| error term of the effects | residual of the main-effects fit, SD {noise['sd']:.4f} on {noise['df']} df "
        f"(lack of fit F = {lof['F']:.2f}, p = {lof['p_value']:.2f}) |",
        f"| smallest level contrast detected with 80 % power (5 %, median) | {d['mde']:.3f} nats |",
        f"| runs per configuration to detect 0.05 nats (80 % power, t on {floor['df']} df) | {d['needed']} |",
    ]
    return "\n".join(lines)


def doe20_effects(d: dict) -> str:
    lines = ["| contrast (level − reference) | effect | 95 % CI | p | Holm p | verdict |", "|---|---|---|---|---|---|"]
    for c in d["fitted"]["contrasts"]:
        lines.append(
            f"| {c['factor']}: {c['level']} − {c['reference']} | {signed(c['effect'])} | "
            f"{interval(c['ci_low'], c['ci_high'])} | {c['p_value']:.2g} | {c['p_holm']:.2g} | "
            f"{'**resolved**' if c['verdict'] == 'resolved' else 'within noise'} |"
        )
    tests = "; ".join(f"{t['factor']} F = {t['F']:.1f}, Holm p = {t['p_holm']:.2g}" for t in d["tests"])
    return "\n".join(lines) + f"\n\nFactor F tests (type II, residual error, Holm over the five): {tests}."


def doe20_claims() -> str:
    """The claims table of bench/doe20_claims.py, from the same results.csv."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("doe20_claims", REPO / "bench" / "doe20_claims.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    claims = module.doe20_claims(module.read_rows(str(FINDINGS / "doe20-cpu" / "results.csv")))
    lines = [
        "| claim | measured (difference, 95 % CI, p; verdict with Holm over the claims) | does the factor matter? |",
        "|---|---|---|",
    ]
    return "\n".join(lines + [f"| {claim} | {measured} | {overall} |" for claim, measured, overall in claims])
