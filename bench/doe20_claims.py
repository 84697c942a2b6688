#!/usr/bin/env python
"""The methodology claims the lab tests, answered from a finished doe20 (and optional Lion lr grid) results.csv.

For each claim: the least-squares difference that speaks to it (one planned comparison each, 95 % CI on the
main-effects fit's residual df), and the factor's F test, Holm-corrected across the five factors. Prints the
Markdown table of docs/findings/README.md.

  python bench/doe20_claims.py docs/findings/doe20-cpu/results.csv [--lion docs/findings/lion-lr-cpu/results.csv]
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmlab.sweep import stats  # noqa: E402
from llmlab.sweep.design import CONTROL, FACTORS  # noqa: E402

NUMERIC = (
    "final_loss",
    "attention_entropy_last_layer",
    "grad_norm_mean",
    "grad_norm_std",
    "stability_index",
    "steps_to_target",
    "lr",
)


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for key in NUMERIC:
            row[key] = float(row[key]) if row.get(key) not in (None, "", "None") else None
    return rows


def fitted(rows: list[dict], metric: str) -> dict:
    return stats.fit_effects(rows, list(FACTORS), CONTROL, metric, {k: list(v) for k, v in FACTORS.items()})


def fmt(result: dict) -> str:
    if result.get("ci_low") is None:
        return f"{result['difference']:+.3f} (no noise estimate)"
    return (
        f"{result['difference']:+.3f} [{result['ci_low']:+.3f}, {result['ci_high']:+.3f}], p = {result['p_value']:.3g}"
    )


def factor_line(fit: dict, factor: str) -> str:
    test = next((t for t in stats.factor_tests(fit) if t["factor"] == factor), None)
    return f"F test p = {test['p_value']:.3g}, Holm {test['p_holm']:.3g} ({test['verdict']})" if test else "no F test"


def doe20_claims(rows: list[dict]) -> list[tuple[str, str, str]]:
    loss, entropy = fitted(rows, "final_loss"), fitted(rows, "attention_entropy_last_layer")
    spread, mean_norm = fitted(rows, "grad_norm_std"), fitted(rows, "grad_norm_mean")
    stability = fitted(rows, "stability_index")
    shares = stats.variance_shares(rows, list(FACTORS), ["final_loss", "grad_norm_std"], CONTROL)
    interactions = {i["factors"]: i for i in stats.interaction_tests(loss)}
    pair = interactions.get("scheduler x warmup")
    # the claims' headline comparisons are one family: Holm across them decides "resolved"
    primary = [
        stats.level_difference(loss, "warmup", "1000", "100"),
        stats.level_difference(spread, "weight_decay", "0.01", "0.0"),
        stats.level_difference(loss, "clip", "0.5", "1.0"),
        stats.level_difference(loss, "scheduler", "cosine", "linear"),
    ]
    adjusted = stats.holm([d["p_value"] for d in primary])
    verdicts = [
        f" **{'resolved' if p < stats.ALPHA else 'within noise'}** (Holm over {len(primary)} claims: p = {p:.3g})"
        for p in adjusted
    ]
    claims = [
        (
            "Longer warmup lowers the loss and sharpens attention",
            f"final loss, warmup 1000 - 100: {fmt(stats.level_difference(loss, 'warmup', '1000', '100'))}; "
            f"attention entropy, 1000 - 100: {fmt(stats.level_difference(entropy, 'warmup', '1000', '100'))} nats",
            f"loss: {factor_line(loss, 'warmup')}; entropy: {factor_line(entropy, 'warmup')}",
        ),
        (
            "Weight decay acts mostly on the gradient-norm spread, not the loss",
            f"grad-norm std, wd 0.01 - 0: {fmt(stats.level_difference(spread, 'weight_decay', '0.01', '0.0'))}; "
            f"final loss, 0.01 - 0: {fmt(stats.level_difference(loss, 'weight_decay', '0.01', '0.0'))}; share of "
            f"variance: {100 * shares['grad_norm_std'].get('weight_decay', 0):.0f}% of grad-norm std, "
            f"{100 * shares['final_loss'].get('weight_decay', 0):.0f}% of loss",
            f"spread: {factor_line(spread, 'weight_decay')}; mean norm: {factor_line(mean_norm, 'weight_decay')}",
        ),
        (
            "Clipping at 0.5 beats 1.0",
            f"final loss, clip 0.5 - 1.0: {fmt(stats.level_difference(loss, 'clip', '0.5', '1.0'))}; stability index: "
            f"{fmt(stats.level_difference(stability, 'clip', '0.5', '1.0'))}",
            factor_line(loss, "clip"),
        ),
        (
            "Cosine beats linear, depending on the warmup",
            f"final loss, cosine - linear: {fmt(stats.level_difference(loss, 'scheduler', 'cosine', 'linear'))}; "
            + (
                f"scheduler x warmup: F = {pair['F']:.2f} on {pair['df'][0]}, {pair['df'][1]} df (pure error), p = "
                f"{pair['p_value']:.3g}, Holm over {len(interactions)} pairs {pair['p_holm']:.3g}"
                if pair
                else "scheduler x warmup: no pure error to test it"
            ),
            factor_line(loss, "scheduler"),
        ),
    ]
    return [(claim, measured + verdict, overall) for (claim, measured, overall), verdict in zip(claims, verdicts)]


def lion_claim(rows: list[dict]) -> tuple[str, str, str]:
    """Lion's lr window: the range of lrs within 0.05 nats of each optimizer's best, from an optimizer x lr grid."""
    windows = {}
    for optimizer in ("adamw", "lion"):
        by_lr: dict[float, list[float]] = {}
        for row in rows:
            if row.get("optimizer") == optimizer and row["status"] == "ok":
                by_lr.setdefault(row["lr"], []).append(row["final_loss"])
        means = {lr: sum(v) / len(v) for lr, v in sorted(by_lr.items())}
        best = min(means.values())
        good = [lr for lr, loss in means.items() if loss <= best + 0.05]
        windows[optimizer] = (min(good), max(good), best, means)
    noise = stats.pure_error(rows, "final_loss")
    text = "; ".join(
        f"{o}: best {w[2]:.3f} nats, lrs within 0.05 of it {w[0]:g}-{w[1]:g} (means "
        + ", ".join(f"{lr:g}: {loss:.3f}" for lr, loss in w[3].items())
        + ")"
        for o, w in windows.items()
    )
    ratio = {o: w[1] / w[0] for o, w in windows.items()}
    return (
        "Lion has a narrower good-lr window than AdamW",
        text + f"; seed SD {noise['sd']:.3f} ({noise['df']} df)",
        f"window width (max/min good lr): AdamW {ratio['adamw']:g}x, Lion {ratio['lion']:g}x",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="results.csv of a doe20 sweep with replicates")
    parser.add_argument("--lion", help="results.csv of an optimizer x lr grid (adamw and lion) with replicates")
    args = parser.parse_args()
    rows = read_rows(args.results)
    claims = doe20_claims(rows)
    if args.lion:
        claims.append(lion_claim(read_rows(args.lion)))
    print("| claim | measured (effect, 95% CI, verdict) | does the factor matter at all? |")
    print("|---|---|---|")
    for claim, measured, overall in claims:
        print(f"| {claim} | {measured} | {overall} |")


if __name__ == "__main__":
    main()
