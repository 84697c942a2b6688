#!/usr/bin/env python
"""Every number README.md and docs/findings/README.md state about the lab, generated from the shipped results.

Each generated block sits between `<!-- findings:NAME -->` and `<!-- /findings:NAME -->` markers; this script
recomputes it from docs/findings/*/results.csv and scaling_fits.json and rewrites it in place, so prose and data
cannot drift apart. `--check` rewrites nothing and exits 1 when a block is stale (the tests run it).

  python scripts/findings.py            # regenerate the blocks
  python scripts/findings.py --check    # fail if any block differs from the data
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmlab.core.identity import file_sha256  # noqa: E402
from llmlab.scaling.optimum import cell_optimum, pure_error  # noqa: E402
from llmlab.scaling.transfer import flat_forecast, flat_verdict, registered_trials  # noqa: E402
from llmlab.sweep import stats  # noqa: E402
from llmlab.sweep.design import CONTROL, FACTORS  # noqa: E402
from llmlab.train.components import OPTIMIZERS  # noqa: E402

LION_LR_DIVISOR = OPTIMIZERS["lion"].lr_divisor
from llmlab.train.components import mean_lr_share  # noqa: E402

FINDINGS = REPO / "docs" / "findings"
DOCUMENTS = (
    REPO / "README.md",
    FINDINGS / "README.md",
    *(REPO / "docs" / f"{name}.md" for name in ("usage", "data", "lab")),
    FINDINGS / "lr-forecast-sp" / "forecast_design.md",
    FINDINGS / "lr-forecast-mup" / "forecast_design.md",
)
LABELS = {"adamw": "AdamW", "lion": "Lion", "adafactor": "Adafactor"}


def signed(value: float, digits: int = 3) -> str:
    return f"{value:+.{digits}f}"


def interval(low: float, high: float, digits: int = 3) -> str:
    return f"[{signed(low, digits)}, {signed(high, digits)}]"


def read_results(folder: Path) -> list[dict]:
    with open(folder / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for key in ("final_loss", "stability_index", "attention_entropy_last_layer", "steps_to_target"):
            row[key] = float(row[key]) if row.get(key) not in (None, "", "None") else None
    return rows


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


def lr_scan(name: str) -> dict | None:
    path = FINDINGS / name / "scaling_fits.json"
    return json.loads(path.read_text())["transfer"] if path.is_file() else None


def _cells_text(transfer: dict) -> str:
    measured = [p["size"] for p in transfer["points"] if p["status"] == "measured"]
    bounds = [f"{p['size']} ({p['status'].replace('_', ' ')})" for p in transfer["points"] if p["status"] != "measured"]
    return f"{len(measured)} of {len(transfer['points'])} cells measured ({', '.join(measured) or 'none'})" + (
        f"; bounds: {', '.join(bounds)}" if bounds else ""
    )


def lr_summary(name: str, label: str) -> str:
    transfer = lr_scan(name)
    if transfer is None:
        return f"_{name}: not run yet_"
    law, holdout, noise = transfer["law"], transfer["holdout"], transfer["noise"]
    per_size = sorted((v["sigma"], size) for size, v in noise["per_size"].items() if v["sigma"])
    trend = noise.get("lr_trend") or {}
    noise_text = (
        f"seed noise σ = {noise['sigma']:.4f} nats pooled ({noise['df']} df), per size from "
        f"{per_size[0][0]:.4f} ({per_size[0][1]}) to {per_size[-1][0]:.4f} ({per_size[-1][1]})"
        + (
            f", growing with lr (slope of ln s² on ln lr {trend['slope_ln_var']:+.2f} "
            f"[{trend['ci'][0]:+.2f}, {trend['ci'][1]:+.2f}], p = {trend['p']:.2g})"
            if trend.get("used")
            else ""
        )
    )
    head = f"{label} ({transfer['points'][0]['seeds_per_lr']:.0f} seeds per lr): {_cells_text(transfer)}; {noise_text}."
    if holdout.get("status") != "ok":
        law_text = (
            f" All measured sizes: α = {law['alpha']:.3f} [{law['alpha_ci'][0]:.3f}, {law['alpha_ci'][1]:.3f}] "
            f"({law['df']} df)."
            if law["status"] == "ok"
            else " No law: too few measured cells."
        )
        return head + f" **held-out: not run** ({holdout.get('reason')}).{law_text}"
    row = holdout["rows"][0]
    ratio = (
        f"forecast / measured = {row['ratio']:.2f} (90 % CI [{row['ci90'][0]:.2f}, {row['ci90'][1]:.2f}], "
        f"95 % CI [{row['ci95'][0]:.2f}, {row['ci95'][1]:.2f}])"
        if "ratio" in row
        else row.get("reason", "")
    )
    fit, flat = holdout["fit"], row.get("flat")
    flat_text = (
        f" **muP's flat prediction: {flat['verdict']}** — the fit sizes' mean lr_opt {flat['predicted']:.3g} / "
        f"measured = {flat['ratio']:.2f} {_ci_text(flat)}."
        if flat
        else ""
    )
    return (
        head + f" **held-out: {holdout['verdict']}** — fitted on {', '.join(holdout['fitted_on'])} (α = "
        f"{fit['alpha']:.3f} [{fit['alpha_ci'][0]:.3f}, {fit['alpha_ci'][1]:.3f}], {fit['df']} df), the law "
        f"forecast {holdout['size']} ({holdout['extrapolation']:.1f}× beyond in N): {ratio}. All measured sizes: "
        f"α = {law['alpha']:.3f} [{law['alpha_ci'][0]:.3f}, {law['alpha_ci'][1]:.3f}] ({law['df']} df); lack of "
        f"fit τ = {law['tau']:.3f} in ln lr." + flat_text
    )


def flat_control(name: str = "lr-forecast-sp") -> str:
    """muP's flat-prediction test applied to the standard scan, whose optimum moves: the test's positive control."""
    transfer = lr_scan(name)
    held = next(p for p in transfer["points"] if p["size"] == transfer["holdout"]["size"])
    forecast = flat_forecast([p for p in transfer["points"] if p is not held])
    flat = flat_verdict(forecast, held)
    return (
        f"Applied to the standard scan, whose optimum falls with N, the same test **{flat['verdict']}**: the mean "
        f"lr_opt of {forecast['sizes'][0]}-{forecast['sizes'][-1]}, {flat['predicted']:.3g}, against "
        f"{held['size']}'s measured {held['lr_opt']:.3g} gives R = {flat['ratio']:.2f} (95 % CI "
        f"[{flat['ci95'][0]:.2f}, {flat['ci95'][1]:.2f}], {flat['df']} df). So the test can tell a moving optimum "
        "from a flat one at this scan's noise."
    )


def _ci_text(verdict: dict) -> str:
    """A verdict's intervals of R = forecast / measured, as every findings sentence states them."""
    return (
        f"(90 % CI [{verdict['ci90'][0]:.2f}, {verdict['ci90'][1]:.2f}], 95 % CI [{verdict['ci95'][0]:.2f}, "
        f"{verdict['ci95'][1]:.2f}], {verdict['df']} df)"
    )


def _verdict_text(verdict: dict) -> str:
    return f"**{verdict['verdict']}**, R = {verdict['ratio']:.2f} {_ci_text(verdict)}"


def second_forecasts() -> str:
    """The README's lines on the second forecasts (issue 33): each scan's registered verdicts, R = forecast /
    measured lr_opt at the held-out size, or how far its held-out trials got."""
    lines = []
    for name, label in (("lr-forecast-sp", "Standard parametrisation"), ("lr-forecast-mup", "muP")):
        registered = json.loads((FINDINGS / name / "preregistration.json").read_text())
        held = registered["held_out"]
        holdout = lr_scan(name)["holdout"]
        row = holdout["rows"][0] if holdout.get("status") == "ok" and holdout.get("size") == held else {}
        head = f"- {label} ([`{name}/`](docs/findings/{name}/forecast_design.md)), {held} held out: "
        if "ratio" not in row:
            done = sum(1 for r in trial_results(FINDINGS / name) if r["hparams"]["size"] == held)
            planned = registered_trials(registered, held)
            lines.append(head + f"{done} of its {planned} registered held-out trials have run; no verdict yet.")
            continue
        flat = row.get("flat")
        lines.append(
            head
            + ("the law's forecast " if flat else "")
            + _verdict_text(row)
            + (f"; muP's flat prediction {_verdict_text(flat)}" if flat else "")
            + f". At the verdict's own SE, a 1.5x miss is caught {row['power']['detect_1.5x_miss']:.0%} of the time."
        )
    return "\n".join(lines)


def mup_vs_std() -> str:
    std, mup = lr_scan("lr-sizes-std"), lr_scan("lr-sizes-mup")
    if std is None or mup is None:
        return "_the muP comparison needs both scans_"
    a_std, a_mup = std["law"], mup["law"]
    if a_std["status"] != "ok" or a_mup["status"] != "ok":
        return (
            "No comparison of α: at 2 seeds per lr too few cells of "
            + " and ".join(n for n, a in (("the standard scan", a_std), ("the muP scan", a_mup)) if a["status"] != "ok")
            + " are measurements (the rest are bounds), so the earlier claim about muP's α is withdrawn."
        )
    low, high = a_mup["alpha_ci"]
    excludes = not low <= a_std["alpha"] <= high
    drift = (math.exp(low * math.log(100)), math.exp(high * math.log(100)))
    return (
        f"α with muP = {a_mup['alpha']:.3f} [{low:.3f}, {high:.3f}] against the standard α = {a_std['alpha']:.3f}: "
        f"the muP interval **{'excludes' if excludes else 'does not exclude'}** the standard α; over 100× in N it "
        f"still allows lr_opt to move {drift[0]:.2f}–{drift[1]:.2f}×, so it does not show that lr_opt stays put."
    )


def target_optimum(data: dict) -> dict:
    """lr_opt at the target, measured: the same vertex-and-bootstrap as the scan's cells, over the recommended YAML's
    runs at every lr (the recommended lr and the grid; the default recipe differs in more than the lr)."""
    same = {name: losses for name, losses in data["losses"].items() if name != "default"}
    trials = [{"lr": data["lrs"][name], "final_loss": loss} for name, losses in same.items() for loss in losses]
    sigma, _df = pure_error(list(same.values()))
    return cell_optimum(trials, sigma)


def recommend_validation() -> str:
    path = FINDINGS / "recommend-validation" / "validation.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    if "recommended_minus_best" not in data:
        return "_bench/recommend_validation.py has not been rerun with seeds yet_"
    lines = ["| config | lr | val loss (mean of seeds) | seeds |", "|---|---|---|---|"]
    for name, losses in data["losses"].items():
        lines.append(
            f"| {name} | {data['lrs'][name]:.3g} | {sum(losses) / len(losses):.4f} | "
            f"{', '.join(f'{x:.4f}' for x in losses)} |"
        )
    versus, default = data["recommended_minus_best"], data["default_minus_best"]
    best, recommended = data["best_grid"], data["lrs"]["recommended"]
    vertex = target_optimum(data)
    measured = (
        f"lr_opt measured at the target (vertex over {vertex['window_lrs']} lrs, {vertex['seeds_per_lr']:.0f} "
        f"seeds each): **{vertex['lr_opt']:.3g}** [{vertex['ci'][0]:.3g}, {vertex['ci'][1]:.3g}] (95 %, "
        f"{100 * vertex['censored_share']:.1f} % of bootstrap draws censored), so recommended / "
        f"measured = **{recommended / vertex['lr_opt']:.2f}**"
        if vertex["status"] == "measured"
        else f"lr_opt at the target: {vertex['status']} ({vertex['reason']})"
    )
    return "\n".join(lines) + (
        f"\n\nRecommended − best grid run ({best}): **{signed(versus['difference'], 4)}** "
        f"{interval(*versus['ci'], 4)} nats (95 % CI, seed SD {versus['seed_sd']:.4f} pooled over all configurations, "
        f"{versus['df']} df); default − best grid: {signed(default['difference'], 4)} {interval(*default['ci'], 4)}; "
        f"recommended lr / best grid lr = {recommended / data['lrs'][best]:.2f}. The best grid run is "
        f"picked by these same runs, so the gap is biased towards the grid. {measured}."
    )


def quoted(answer: str, limit: int = 60) -> str:
    """A generated answer on one line, as JSON would quote it, cut to `limit` characters."""
    text = json.dumps(answer, ensure_ascii=False)
    return f"`{text[:limit]}…`" if len(text) > limit else f"`{text}`"


def lora_results() -> dict:
    path = FINDINGS / "lora-default" / "results.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def lora_default_table(results: dict) -> str:
    """bench/lora_default.py's candidates: test-split perplexity, answer loss and ROUGE-L before -> after, with the
    paired bootstrap CIs train_lora.py wrote to eval.json."""
    lines = [
        "| candidate | wall time | test perplexity before → after (change, 95 % CI) | test answer loss (nats) | "
        "test ROUGE-L before → after (change, 95 % CI) |",
        "|---|---|---|---|---|",
    ]
    for name, result in results.items():
        report = result["report"]
        before, after, change = report["before"]["test"], report["after"]["test"], report["change"]["test"]
        ppl, rouge = change["perplexity"], change["rougeL"]
        lines.append(
            f"| {name} | {result['seconds'] / 60:.1f} min | {before['perplexity']:.0f} → "
            f"{after['perplexity']:.0f} ({signed(ppl['change'], 0)} {interval(*ppl['ci'], 0)}) | "
            f"{before['loss']:.2f} → {after['loss']:.2f} | {before['rougeL']:.3f} → {after['rougeL']:.3f} "
            f"({signed(rouge['change'])} {interval(*rouge['ci'])}) |"
        )
    return "\n".join(lines)


def lora_default_summary() -> str:
    """The chosen default's before -> after on the test split, and two of its answers."""
    results = lora_results()
    if not results:
        return "_bench/lora_default.py has not been run yet_"
    name, result = min(results.items(), key=lambda item: item[1]["report"]["after"]["test"]["loss"])
    report = result["report"]
    before, after, change = report["before"]["test"], report["after"]["test"], report["change"]["test"]
    ppl, rouge = change["perplexity"], change["rougeL"]
    lines = [
        "| test split | before | after | change (95 % CI, paired bootstrap) |",
        "|---|---|---|---|",
        f"| perplexity ({report['test_examples']} examples) | {before['perplexity']:.0f} | "
        f"{after['perplexity']:.0f} | {signed(ppl['change'], 0)} {interval(*ppl['ci'], 0)} |",
        f"| answer loss, nats | {before['loss']:.2f} | {after['loss']:.2f} | |",
        f"| ROUGE-L ({rouge['examples']} greedy answers) | {before['rougeL']:.3f} | {after['rougeL']:.3f} | "
        f"{signed(rouge['change'])} {interval(*rouge['ci'])} |",
    ]
    shown = [e for e in report["examples"] if e["after"].strip()][:2] or report["examples"][:2]
    answers = [
        f"- {e['instruction']} Reference: {quoted(e['reference'])}; before: {quoted(e['before'])}; after: "
        f"{quoted(e['after'])}"
        for e in shown
    ]
    return "\n".join(
        [
            f"Defaults = {name}: {result['seconds'] / 60:.1f} min wall on 2 cores, both evaluations included.",
            "",
            *lines,
            "",
            *answers,
        ]
    )


def ray_launcher() -> str:
    """bench/ray_launcher.py: overhead per trial against the local launchers, and 2 nodes against 1."""
    path = FINDINGS / "ray-launcher" / "ray_launcher.json"
    if not path.is_file():
        return "_bench/ray_launcher.py has not been run yet_"
    data = json.loads(path.read_text())
    rows = data["overhead"]
    fork = rows[0]["median_overhead_s"]
    lines = [
        f"`python bench/ray_launcher.py` on this 2-core machine (Ray bound to 127.0.0.1). Overhead per trial, "
        f"{rows[0]['trials']} smoke trials through each launcher one at a time (medians):",
        "",
        "| launcher | s per trial | overhead s | overhead / fork server's |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['launcher']} | {r['median_s_per_trial']:.2f} | {r['median_overhead_s']:.2f} | "
        f"{r['median_overhead_s'] / fork:.1f}x |"
        for r in rows
    ]
    one, two = data["scan_one_node_s"], data["scan_two_nodes_s"]
    lines += [
        "",
        "A cpu-budget lr scan (4 trials x 200 steps), `sweep.py --launcher ray` end to end:",
        "",
        "| cluster | wall time | speedup |",
        "|---|---|---|",
        f"| 1 node x 1 CPU | {one / 60:.1f} min | 1.00x |",
        f"| 2 nodes x 1 CPU | {two / 60:.1f} min | {one / two:.2f}x |",
    ]
    return "\n".join(lines)


def data_scale() -> str:
    """bench/data_scale.py's table, slopes and projections, from docs/findings/data-scale/results.json."""
    path = FINDINGS / "data-scale" / "results.json"
    if not path.is_file():
        return "_bench/data_scale.py has not run yet_"
    data = json.loads(path.read_text())
    lines = [
        "| corpus | pipeline | tokens | seconds | tokens/s | peak memory (PSS, MB) | bytes / token |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        name = r["pipeline"] + (f" (earlier run, {r['machine']})" if r.get("earlier_run") else "")
        lines.append(
            f"| {r['corpus_mb']} MB | {name} | {r['tokens']:,} | {r['seconds']:.1f} | "
            f"{r['tokens_per_second']:,.0f} | {r['peak_rss_mb']:,.0f} | {r['bytes_per_token']:.2f} |"
        )
    s = data["summary"]
    lines += [
        "",
        "| pipeline | memory: base + per 100M tokens (per document) | 1B tokens: hours, disk GB, "
        "peak GB | 10B tokens: hours, "
        "disk GB, peak GB |",
        "|---|---|---|---|",
    ]
    for name, fit in s.items():
        if name == "ratios":
            continue
        p1, p10 = fit["projection"]["1B"], fit["projection"]["10B"]
        lines.append(
            f"| {name} | {fit['rss_base_mb']:,.0f} MB + {fit['rss_mb_per_100m_tokens']:,.0f} MB "
            f"({fit['rss_kb_per_document']:.1f} KB) | "
            f"{p1['hours']:.1f} h, {p1['disk_gb']:.0f} GB, {p1['peak_rss_gb']:.1f} GB | {p10['hours']:.1f} h, "
            f"{p10['disk_gb']:.0f} GB, {p10['peak_rss_gb']:.1f} GB |"
        )
    ratios = "; ".join(f"{k.replace(' tokens/s', '')} = {v:.2f}×" for k, v in s.get("ratios", {}).items())
    loader = data.get("loader") or {}
    wait = (
        f" Training on the {data['sizes_mb'][-1]} MB shards ({loader['steps']} steps of gpt2-tiny): the loader "
        f"waited {100 * loader['data_wait_share_max']:.3f} % of step time at most."
        if "steps" in loader
        else ""
    )
    return "\n".join(lines) + (
        f"\n\nSide by side in one run on {data['machine']}, {data['workers']} workers: tokens/s ratios {ratios}.{wait}"
    )


def data_scale_summary() -> str:
    """The README's sentence on data at scale with the defaults (near-dup on): the largest corpus's peak memory and
    its speed against nanoGPT's recipe side by side, the line fit's projection, the disk bytes."""
    data = json.loads((FINDINGS / "data-scale" / "results.json").read_text())
    fit = data["summary"]["llmlab"]
    largest = data["sizes_mb"][-1]
    row = [r for r in data["rows"] if r["pipeline"] == "llmlab" and r["corpus_mb"] == largest][-1]
    ratio = data["summary"]["ratios"][f"{largest} MB llmlab / nanogpt tokens/s"]
    ten = fit["projection"]["10B"]
    per_doc = row["dedup"]["near_dup_disk_bytes_per_document"]
    return (
        f"With the defaults, near-dup on, {largest:,} MB of text ({row['tokens'] / 1e6:.0f}M tokens) prepared at "
        f"{ratio:.2f}× the tokens/s of nanoGPT's recipe side by side, with a {row['peak_rss_mb']:,.0f} MB peak. A line "
        f"through the three sizes gives {fit['rss_base_mb']:,.0f} MB + {fit['rss_mb_per_100m_tokens']:.0f} MB per 100M "
        f"tokens, {ten['peak_rss_gb']:.1f} GB at 10B tokens"
        f". Near-dup's band keys take {per_doc:.0f} bytes a document on disk while it runs "
        f"({per_doc * 1e10 / (row['tokens'] / row['documents']) / 1e9:.1f} GB at 10B tokens of these documents)."
    )


def near_dup_quality() -> str:
    """bench/near_dup_quality.py's planted-pair curve: share removed per Jaccard bin, recall and precision."""
    data = json.loads((FINDINGS / "data-scale" / "near_dup_quality.json").read_text())
    lines = ["| Jaccard to its original | planted copies | removed | share (95 % CI) |", "|---|---|---|---|"]
    for row in data["bins"]:
        share = (
            "–"
            if row["share_removed"] is None
            else (f"{row['share_removed']:.3f} [{row['ci95'][0]:.3f}, {row['ci95'][1]:.3f}]")
        )
        lines.append(
            f"| [{row['jaccard_from']:.3f}, {row['jaccard_to']:.3f}) | {row['copies']} | {row['removed']} | {share} |"
        )
    s = data["summary"]
    return "\n".join(lines) + (
        f"\n\n{data['bases']} originals and one planted copy of each, prepared by the pipeline (threshold "
        f"{data['threshold']}, two workers, copies in later files and shards) on {data['machine']}: recall "
        f"{s['recall_at_0.9']:.3f} at Jaccard ≥ 0.9 and {s['recall_at_threshold']:.3f} at ≥ {data['threshold']}, "
        f"precision {s['precision']:.3f} ({s['removed_below_threshold']} copies below the threshold and "
        f"{s['bases_removed']} originals removed)."
    )


def near_dup_groups() -> str:
    """bench/near_dup_quality.py --copies 2 10 --before: recall per group size, now and before, side by side."""
    data = json.loads((FINDINGS / "data-scale" / "near_dup_groups.json").read_text())
    before = data["before"]
    lines = ["| group size (copies of one base) | true duplicates | recall now (95 % CI) | recall before |",
             "|---|---|---|---|"]  # fmt: skip
    for now_row, old_row in zip(data["by_group_size"], before["by_group_size"]):
        lines.append(
            f"| {now_row['group_size']} | {now_row['true_duplicates']} | {now_row['recall']:.3f} "
            f"[{now_row['ci95'][0]:.3f}, {now_row['ci95'][1]:.3f}] | {old_row['recall']:.3f} |"
        )
    s, b = data["summary"], before["summary"]
    copies = sum(row["copies"] for row in data["bins"])
    return "\n".join(lines) + (
        f"\n\n{data['bases']} bases, each with {data['copies_per_base'][0]}-{data['copies_per_base'][1]} copies "
        f"({copies} in all, each with 0-6 % of its words replaced on its own, shuffled after the bases), threshold "
        f"{data['threshold']}, on {data['machine']}. Copies at Jaccard ≥ {data['threshold']} to their base that "
        f"survive: {s['surviving_true_duplicates']} now, {b['surviving_true_duplicates']} before ({before['commit']}): "
        f"recall {s['recall_at_threshold']:.4f} against {b['recall_at_threshold']:.4f}. Precision "
        f"{s['precision']:.3f} now and {b['precision']:.3f} before: {s['removed_below_threshold']} copies below the "
        f"threshold and {s['bases_removed']} bases removed. The near-dup stage took {s['near_dup_seconds']:.1f} s "
        f"now and {b['near_dup_seconds']:.1f} s before ({s['near_dup_seconds'] / b['near_dup_seconds']:.2f}x, one "
        f"run each, side by side), its disk {s['near_dup_disk_bytes_per_document']:.0f} bytes a document against "
        f"{b['near_dup_disk_bytes_per_document']:.0f}."
    )


def one_document() -> str:
    """bench/one_document.py: peak memory against the size of a one-document corpus, now and before."""
    data = json.loads((FINDINGS / "data-scale" / "one_document.json").read_text())
    rows = {(r["tree"], r["document_mb"]): r for r in data["rows"]}
    lines = ["| one document of | peak now | peak before | tokens | seconds now |", "|---|---|---|---|---|"]
    for size in sorted({mb for _, mb in rows}):
        now, old = rows[("now", size)], rows.get(("before", size))
        before = f"{old['peak_rss_mb']:,.0f} MB" if old else "not run"
        lines.append(
            f"| {size:,} MB | {now['peak_rss_mb']:,.0f} MB | {before} | {now['tokens']:,} | {now['seconds']:.0f} |"
        )
    refused = data["json_line"]
    return "\n".join(lines) + (
        f"\n\nPeak PSS of the whole process tree ({data['workers']} workers), the corpus a single .txt.gz; before = "
        f"{data['before']}, run side by side up to 256 MB. A single JSON line of {data['json_line_gb']:g} GB is "
        f"refused in {refused['seconds']:.0f} s, before it is read whole. On {data['machine']}."
    )


def minhash_speed() -> str:
    """bench/minhash_speed.py's table: signature cost per token against tiktoken's, one core."""
    data = json.loads((FINDINGS / "data-scale" / "minhash_speed.json").read_text())
    lines = ["| candidate | median s | tokens/s | time × tiktoken's |", "|---|---|---|---|"]
    for row in data["rows"]:
        if row["installed"]:
            cells = (
                row["candidate"],
                f"{row['median_s']:.3f}",
                f"{row['tokens_per_s']:,}",
                f"{row['cost_vs_tiktoken']:.2f}",
            )
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + (
        f"\n\n{data['documents']:,} documents ({data['tokens']:,} tokens), one core, median of {data['repeats']} "
        f"interleaved runs on {data['cpu']}."
    )


def host_syncs() -> str:
    """bench/host_syncs.py before and after the step stopped reading back: each run's last line is its JSON."""
    runs = {
        when: json.loads((FINDINGS / "fast-path" / f"host_syncs_{when}.txt").read_text().strip().splitlines()[-1])
        for when in ("before", "after")
    }
    before, after = runs["before"], runs["after"]
    lines = ["| per optimizer step (2 micro-batches) | before | after |", "|---|---|---|"]
    for name, label in (
        ("trial, clip norm", "a sweep trial, norm clipping"),
        ("trial, clip value", "a sweep trial, value clipping"),
        ("trial, clip norm, measured step", "a sweep trial, a measured step (per-layer ratio probes)"),
    ):
        lines.append(f"| {label} | {before[name]['total']:.0f} | {after[name]['total']:.0f} |")
    old, new = before["train_pretrain.py"], after["train_pretrain.py"]
    lines.append(
        f"| train_pretrain.py, a step that does not log | {old['other steps']:.0f} | {new['other steps']:.0f} |"
    )
    lines.append(
        f"| train_pretrain.py, a log step (every 5th here) | {old['log steps']:.0f} | {new['log steps']:.0f} |"
    )
    return "\n".join(lines)


def forecast_fragility(short: bool = False) -> str:
    """bench/forecast_fragility.py: the first forecast's verdict under fair alternative analyses, and Holm."""
    data = json.loads((FINDINGS / "lr-forecast" / "fragility.json").read_text())
    rows, holm = data["analyses"], {h["scan"]: h for h in data["holm"]}
    first = holm["lr-forecast"]
    others = [r for r in rows[2:] if r["verdict"] != "failed"]
    if short:
        return (
            f"**That `failed` is fragile:** {len(others)} of {len(rows) - 2} fair alternative analyses give undecided "
            f"(each seed block left out in turn, one machine's trials alone, a quadratic over all the held-out lrs, "
            f"the bootstrap's centre), and Holm over the lab's three registered forecasts takes its p from "
            f"{first['p']:.3f} to {first['p_holm']:.3f} (undecided); "
            "[docs/findings](docs/findings/README.md#the-pre-registered-forecast-issue-26--lr-forecast) has the table."
        )
    lines = ["| analysis | verdict | R (95 % CI) | note |", "|---|---|---|---|"]
    for row in rows:
        ratio = f"{row['ratio']:.2f} [{row['ci95'][0]:.2f}, {row['ci95'][1]:.2f}]" if "ratio" in row else "–"
        lines.append(f"| {row['analysis']} | {row['verdict']} | {ratio} | {row.get('note', '')} |")
    family = "; ".join(
        f"{h['scan']} R {h['ratio']:.2f}, p {h['p']:.3f}, Holm p {h['p_holm']:.3f}" for h in holm.values()
    )
    return "\n".join(lines) + f"\n\nHolm over the three registered forecasts (two-sided t of ln R = 0): {family}."


def coord_check() -> str:
    """bench/coord_check.py: the slope of ln RMS on ln width per parametrization, coordinate and step."""
    folder = FINDINGS / "coord-check"
    with open(folder / "slopes.csv", newline="") as f:
        slopes = {(r["parametrization"], int(r["step"]), r["what"]): float(r["slope"]) for r in csv.DictReader(f)}
    machine = json.loads((folder / "run_info.json").read_text())
    args = machine["args"]
    steps = sorted({step for _, step, _ in slopes})
    shown = [steps[0], steps[1], steps[len(steps) // 2], steps[-1]]
    coordinates = ("attn", "mlp", "residual", "logits")
    lines = [
        "| parametrization | step | " + " | ".join(coordinates) + " |",
        "|---|---|" + "---|" * len(coordinates),
    ]
    for parametrization in ("standard", "mup"):
        for step in shown:
            cells = " | ".join(f"{slopes[parametrization, step, what]:+.2f}" for what in coordinates)
            lines.append(f"| {'muP' if parametrization == 'mup' else parametrization} | {step} | {cells} |")
    widths = ", ".join(str(w) for w in args["widths"])
    hidden = ("attn", "mlp", "residual")
    sp = [slopes["standard", step, what] for step in steps[2:] for what in hidden]
    sp_logits = [slopes["standard", step, "logits"] for step in steps[2:]]
    mup = max(abs(slopes["mup", step, what]) for step in steps for what in hidden)
    lines.append(
        f"\nFrom step 3 on, the standard parametrization's hidden slopes span {min(sp):+.2f} to {max(sp):+.2f} and its "
        f"logits' {min(sp_logits):+.2f} to {max(sp_logits):+.2f}; muP's hidden slopes stay within ±{mup:.2f} at every "
        f"step, and its logits' rise from {slopes['mup', steps[0], 'logits']:+.2f} to "
        f"{slopes['mup', steps[-1], 'logits']:+.2f}."
    )
    return "\n".join(lines) + (
        f"\n\nSlope of ln RMS on ln width (widths {widths}; RMS averaged over {args['seeds']} seeds and over the "
        f"blocks), GPT-2 of {args['depth']} layers with heads of 64, AdamW lr {args['lr']:g}, {args['batch']} x "
        f"{args['seq']} tokens of builtin:wiki a step, muP base width {args['base_width']}; step 1 is the initial "
        f"model; on {machine['cpu']}."
    )


def _paired(row: dict, base: dict) -> str:
    """row / base round by round (the runs of one round ran back to back): median and range."""
    ratios = [a / b for a, b in zip(row["rounds"], base["rounds"])]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def fast_path_cpu() -> str:
    """bench/gpu_throughput.py --ablate all on this CPU: the three trainers, then llmlab with one piece changed."""
    data = json.loads((FINDINGS / "fast-path" / "cpu_throughput.json").read_text())
    rows, args = data["rows"], data["args"]
    lines = ["| trainer | tokens/s (median) | vs nanoGPT's recipe (range) |", "|---|---|---|"]
    lines += [
        f"| {name} | {row['tokens_per_sec']:,.0f} | {_paired(row, rows['nanogpt'])} |" for name, row in rows.items()
    ]
    lines += ["", "| llmlab, one piece changed | tokens/s (median) | vs llmlab (range) |", "|---|---|---|"]
    labels = {
        "fp32": "fp32 instead of bf16 autocast",
        "eager-attention": "eager attention instead of SDPA",
        "foreach-adamw": "AdamW foreach instead of fused",
        "compile": "torch.compile on (off by default on a CPU)",
        "no-tf32": "TF32 off (GPU only: no effect here)",
        "no-pin-memory": "pinned memory off (GPU only: no effect here)",
        "log-every-step": "a log step (a host read) every step",
    }
    for key, row in data["ablations"].items():
        lines.append(f"| {labels[key]} | {row['tokens_per_sec']:,.0f} | {_paired(row, rows['llmlab'])} |")
    return "\n".join(lines) + (
        f"\n\n{args['model']}, batch {args['batch_size']} x {args['block_size']} tokens, {args['steps']} steps "
        f"(first {args['skip']} untimed), each run in a fresh process; {args['repeats']} rounds of every run back to "
        f"back, ratios paired within a round; on {data['cpu']}."
    )


def forecast_design(name: str = "lr-forecast", label: str = "registered", file: str = "design_rationale.json") -> str:
    """A registered design's simulated error rates against the other candidates (bench/forecast_design.py)."""
    path = FINDINGS / name / file
    if not path.is_file():
        return "_bench/forecast_design.py has not run yet_"
    data = json.loads(path.read_text())
    keys = list(dict.fromkeys(k for row in data["designs"].values() for w in data["world"] for k in row[w]))
    header = " | ".join(k.replace("|", "\\|") for k in keys)  # a bare | inside a cell splits it
    lines = ["| design | trials | world | " + header + " |", "|---|---|---|" + "---|" * len(keys)]
    for name, row in data["designs"].items():
        for world in data["world"]:
            lines.append(
                f"| {name}{f' **({label})**' if name == data['chosen'] else ''} | {row['trials']} | {world} | "
                + " | ".join(f"{row[world][k]:.0%}" if k in row[world] else "-" for k in keys)
                + " |"
            )
    pinned = ", ".join(f"{size} {v['sigma']:.4f} ({v['df']} df)" for size, v in data["facts"]["pinned"].items())
    return "\n".join(lines) + (
        f"\n\n{data['reps']} simulated scans per design, world and miss. Seed SD pinned on "
        f"{data['facts']['machine']}: {pinned}."
    )


POWER = "power: P(95 % CI excludes 1 | 1.5x miss)"


def worst_judged_power(row: dict, judged: list[str]) -> tuple[float, str]:
    """A design's power in its least favourable judged world, and that world."""
    return min((row[world][POWER], world) for world in judged)


def forecast_design_power(name: str = "lr-forecast-mup") -> str:
    """The design's case in one list: each number of fit sizes' best power in its least favourable judged world,
    the chosen design's, and the chosen design's on the larger recheck."""
    data = json.loads((FINDINGS / name / "design_rationale.json").read_text())
    judged, best = data["judged_on"], {}
    for label, row in data["designs"].items():
        k = len(row["design"]["fit_sizes"])
        power, world = worst_judged_power(row, judged)
        if k not in best or power > best[k][0]:
            best[k] = (power, world, label)
    lines = [
        f"- {k} fit sizes: {power:.0%} at best ({label}; least favourable world: {world})"
        + (" **(chosen)**" if label == data["chosen"] else "")
        for k, (power, world, label) in sorted(best.items())
    ]
    check = FINDINGS / name / "design_check_120.json"
    if check.is_file():
        again = json.loads(check.read_text())
        power, world = worst_judged_power(again["designs"][again["chosen"]], again["judged_on"])
        lines.append(f"- the chosen design rerun with {again['reps']} new simulated scans: {power:.0%} ({world})")
    return (
        f"Power to catch a 1.5x miss (95 % CI excludes 1), target {data['target']:.0%}, from "
        f"{data['reps']} simulated scans per design, world and miss:\n" + "\n".join(lines)
    )


def forecast_noise(name: str = "lr-forecast-sp") -> str:
    """The noise a registered design was simulated with against the noise its scan then showed, size by size, and
    what the verdict's interval was made of."""
    folder = FINDINGS / name
    fits = folder / "scaling_fits.json"
    if not fits.is_file():
        return "_the scan has not finished_"
    rationale = json.loads((folder / "design_rationale.json").read_text())
    planned, registered = rationale["world"], rationale["summary"]
    transfer = json.loads(fits.read_text())["transfer"]
    vertex = {p["size"]: p for p in transfer["points"]}
    worlds = list(planned)
    lines = [
        "| size | " + " | ".join(f"planned σ ({w})" for w in worlds) + " | measured σ (df) | measured / planned "
        f"({worlds[0]}) | the vertex's SE in ln lr |",
        "|---|" + "---|" * (len(worlds) + 3),
    ]
    for size, measured in sorted(transfer["noise"]["per_size"].items(), key=lambda kv: vertex[kv[0]]["n_params"]):
        sigmas = [planned[w]["sigma"][size] for w in worlds]
        lines.append(
            f"| {size} | "
            + " | ".join(f"{v:.4f}" for v in sigmas)
            + f" | {measured['sigma']:.4f} ({measured['df']}) | "
            f"{measured['sigma'] / sigmas[0]:.1f}× | {math.sqrt(vertex[size]['var_ln']):.3f} |"
        )
    row = transfer["holdout"]["rows"][0]
    forecast = json.loads((folder / "preregistration.json").read_text())["forecast"]["law"]
    held = math.sqrt(vertex[transfer["holdout"]["size"]]["var_ln"])
    power = row["power"]
    return "\n".join(lines) + (
        f"\n\nThe verdict's SE of ln R was {row['se_ln']:.3f} ({row['df']} df): the registered forecast's own "
        f"{forecast['se_mean']:.3f} and the held-out vertex's {held:.3f}. At that SE, P(within | exact) is "
        f"{power['within_at_exact']:.0%} and P(95 % CI excludes 1 | 1.5x miss) {power['detect_1.5x_miss']:.0%} "
        f"(P(failed | 2x miss) {power['failed_at_2x']:.0%}), where the registered simulation gave "
        f"{registered['P(within | exact)']:.0%} and {registered['power: P(95 % CI excludes 1 | 1.5x miss)']:.0%}."
    )


def forecast_recheck(name: str = "lr-forecast-sp") -> str:
    """The registered design replayed through the design simulation with the noise its fit cells then showed (6
    seeds, extended lrs), with and without the law's measured scatter, against the power its verdict realised."""
    folder = FINDINGS / name
    row = json.loads((folder / "scaling_fits.json").read_text())["transfer"]["holdout"]["rows"][0]
    lines = [
        "| simulated world | P(within \\| exact) | P(95 % CI excludes 1 \\| 1.5x miss) | P(failed \\| 2x miss) |",
        "|---|---|---|---|",
    ]
    for file, planted in (("design_recheck_no_scatter.json", "no scatter"), ("design_recheck.json", "")):
        recheck = json.loads((folder / file).read_text())
        tau = recheck["facts"]["law_scatter_sd"]
        for world in recheck["facts"]["judged_on"]:
            rates = recheck["designs"][recheck["chosen"]][world]
            lines.append(
                f"| {world}, {planted or f'scatter τ = {tau:.3f}'} | {rates['P(within | exact)']:.0%} | "
                f"{rates['power: P(95 % CI excludes 1 | 1.5x miss)']:.0%} | {rates['P(failed | 2x miss)']:.0%} |"
            )
    power = row["power"]
    lines.append(
        f"| realised (the verdict's own SE {row['se_ln']:.3f}, {row['df']} df) | {power['within_at_exact']:.0%} | "
        f"{power['detect_1.5x_miss']:.0%} | {power['failed_at_2x']:.0%} |"
    )
    return "\n".join(lines) + (
        f"\n\n{recheck['reps']} simulated scans per world and miss, of the registered design "
        f"({recheck['chosen']}); the worlds' σ comes from the fit cells alone, never the held-out size's."
    )


def _ratio_text(row: dict) -> str:
    return (
        f"forecast / measured = **{row['ratio']:.2f}** {_ci_text(row)}, measured lr_opt "
        f"{row['measured']:.3g} [{row['measured_ci'][0]:.3g}, {row['measured_ci'][1]:.3g}]"
    )


def sigma_study_before_registration() -> str:
    """The held-out size's trials that ran before the registration (the sigma study), and where they put its minimum."""
    rows = [r for r in trial_results(FINDINGS / "lr-forecast-sigma") if r["hparams"]["size"] == "320x2"]
    by_lr: dict[float, list[float]] = {}
    for r in rows:
        by_lr.setdefault(r["hparams"]["lr"], []).append(r["final_loss"])
    means = ", ".join(f"{lr:.3g}: {sum(v) / len(v):.3f} ({len(v)} seeds)" for lr, v in sorted(by_lr.items()))
    best = min(by_lr, key=lambda lr: sum(by_lr[lr]) / len(by_lr[lr]))
    return (
        f"{len(rows)} trials at 320x2 from the seed-noise study (`lr-forecast-sigma/`) had finished before the "
        f"registration, and their seed means already put the minimum at {best:.3g} (mean final loss by lr: {means}); "
        "the registration was not blind to the held-out size."
    )


def registration_timing(name: str, held: str) -> str:
    """When the registration was committed against the held-out trials: from each held-out result's recorded commit
    (the scan now waits for it), or, for a scan from before that rule, from its registration_timing.json."""
    folder = FINDINGS / name
    commits = set()
    for path in folder.glob(f"trials/{held}_*/result.json"):
        commits.add((json.loads(path.read_text()).get("registration") or {}).get("commit"))
    if commits and None not in commits:
        return f", and committed ({', '.join(c[:7] for c in sorted(commits))}) before any of them started"
    path = folder / "registration_timing.json"
    if not path.is_file():
        return ""
    timing = json.loads(path.read_text())
    first = timing["first_trials"]
    early = [t for t in first if t["logger_started"] < timing["commit_time"]]
    if not early:
        return f", and committed ({timing['registration_commit'][:7]}) before any of them started"
    written = max(t["result_written_about"] for t in early) - timing["commit_time"]
    started = timing["commit_time"] - min(t["logger_started"] for t in early)
    return (
        f"; but not committed before all of them: {len(early)} {held} trials started {started} s before its commit "
        f"{timing['registration_commit'][:7]} and wrote their results about {written} s after it (no result existed "
        "at the commit, and the forecast reproduces from the fit trials alone: blind to the results by seconds, "
        "not by rule; a scan now holds its held-out trials until the registration is committed)"
    )


def registration(name: str) -> str:
    """What a scan registered before its held-out size's first trial, with the file's sha256: the law's forecast,
    muP's flat prediction where the scan registered one, the rules, and the held-out design the verdict waits for."""
    path = FINDINGS / name / "preregistration.json"
    if not path.is_file():
        return f"_`{name}/` has registered nothing yet: it is still running its fit sizes._"
    reg = json.loads(path.read_text())
    forecast, design = reg["forecast"], reg["design"]
    law, held = forecast["law"], reg["held_out"]
    machines = "1 machine" if len(reg["machines"]) == 1 else f"{len(reg['machines'])} machines"
    written = (
        f"before any {held} trial existed"
        if reg["written_before_held_out_trials"]
        else f"**after {held} trials had run: not blind**"
    ) + registration_timing(name, held)
    text = (
        f"Registered in `{name}/preregistration.json` (sha256 `{file_sha256(path)}`), {written}, from "
        f"{reg['fit_trials']} fit trials on {machines}: the law fitted on "
        f"{', '.join(law['sizes'])} (α = {forecast['alpha']:.3f}, SE {math.sqrt(law['cov'][1][1]):.3f}, "
        f"{law['df']} df) forecasts lr_opt({held}) = **{forecast['lr']:.3g}** (95 % prediction interval "
        f"[{forecast['prediction_interval'][0]:.3g}, {forecast['prediction_interval'][1]:.3g}])"
    )
    flat = reg.get("flat_forecast") or {}
    if flat.get("status") == "ok":
        text += (
            f"; muP's flat prediction, the geometric mean of the {len(flat['sizes'])} fit sizes' lr_opt, is "
            f"**{flat['lr']:.3g}** (SE {flat['se_mean']:.3f} in ln lr, {flat['df']} df)"
        )
    lrs = design["held_out_lrs"]
    return text + (
        f". Estimator `{reg['estimator']['name']}`; the registered held-out design: {len(lrs)} lrs ({lrs[0]:.3g} to "
        f"{lrs[-1]:.3g}) × {design['held_out_seeds']} seeds at {held}, all of which the verdict waits for"
        + ("; a machine term where its trials ran on CPUs with different numerics." if reg.get("machine_term") else ".")
    )


def lr_forecast() -> str:
    """The pre-registered forecast and its verdict, or how far the scan got."""
    folder = FINDINGS / "lr-forecast"
    registration = folder / "preregistration.json"
    fits = folder / "scaling_fits.json"
    if not registration.is_file():
        return "_The registered scan has not reached its held-out size yet: no forecast is registered._"
    reg = json.loads(registration.read_text())
    forecast = reg["forecast"]
    head = (
        f"Pre-registered before this scan's first held-out trial (`lr-forecast/preregistration.json`, sha256 "
        f"`{file_sha256(registration)[:16]}…`): the law fitted on {', '.join(forecast['law']['sizes'])} forecast "
        f"lr_opt({reg['held_out']}) = **{forecast['lr']:.3g}** (95 % prediction interval "
        f"[{forecast['prediction_interval'][0]:.3g}, {forecast['prediction_interval'][1]:.3g}]). "
        + sigma_study_before_registration()
    )
    if not fits.is_file():
        return head + " The held-out trials have not finished: no verdict yet."
    transfer = json.loads(fits.read_text())["transfer"]
    holdout = transfer["holdout"]
    if holdout.get("status") != "ok" or "ratio" not in holdout["rows"][0]:
        return head + f" Verdict: not available ({holdout.get('reason') or holdout['rows'][0].get('reason')})."
    blocked = holdout["rows"][0]
    raw = (holdout.get("as_registered") or {}).get("rows", [{}])[0]
    if "ratio" not in raw:
        return head + f" **Held-out: {blocked['verdict']}**: {_ratio_text(blocked)}."
    text = (
        head + f"\n\n**As registered: {raw['verdict']}** — {_ratio_text(raw)}; the registered analysis pools "
        f"the {len(transfer['machines'])} machines the held-out trials ran on as one. **Blocked, with a machine "
        f"term (a declared deviation): {blocked['verdict']}** — {_ratio_text(blocked)}."
    )
    for term in transfer["machine_terms"]:
        for off in term.get("offsets", []):
            tilt = off["interaction"]
            text += (
                f" Machine term at {term['size']}: {off['machine']} − {term['reference']} = "
                f"{off['offset']:+.4f} nats [{off['ci'][0]:+.4f}, {off['ci'][1]:+.4f}] ({term['df']} df, "
                f"{off['trials']} trials, {off['shared_lrs']} lrs shared)"
            )
            if tilt.get("status") == "ok":
                text += (
                    f"; machine × ln lr {tilt['slope']:+.4f} nats per unit ln lr (p = {tilt['p']:.2g}; the "
                    f"design detects ±{tilt['detectable_slope']:.4f} with 80 % power)"
                )
            text += "."
    return text


def realised_power() -> str:
    """The registered design's error rates re-simulated from the noise its fit cells really show."""
    folder = FINDINGS / "lr-forecast"
    data = json.loads((folder / "realised_power.json").read_text())
    other = json.loads((folder / "realised_power_earlier_bowls.json").read_text())
    registered = json.loads((folder / "design_rationale.json").read_text())["summary"]
    world = data["world"]["as measured"]
    sigmas = ", ".join(f"{size} {sigma:.3f}" for size, sigma in world["sigma"].items())
    trend = data["facts"]["lr_trend"]
    lines = [
        "| error rate | registered (σ pinned at low lrs) | realised: fit cells' noise, bowls and law "
        "| fit cells' noise, earlier scan's bowls, α −0.47 |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {key} | {registered[key]:.0%} | {value:.0%} | {other['summary'][key]:.0%} |"
        for key, value in data["summary"].items()
    ]
    return "\n".join(lines) + (
        f"\n\n{data['reps']} simulated scans per miss and world. Seed SD per size from the fit cells' own pure error "
        f"({sigmas}; 320x2 extrapolated), its slope in lr {trend['slope_ln_var']:+.2f} "
        f"[{trend['ci'][0]:+.2f}, {trend['ci'][1]:+.2f}] in ln s² per ln lr (p = {trend['p']:.2g}, {trend['groups']} "
        f"replicated lrs, " + ("used" if trend["used"] else "not significant, not used") + "); the law's α "
        f"{world['alpha']:.3f}."
    )


def forecast_machines() -> str:
    """The machines the registered scan ran on, each machine's replay of a finished trial, and what each ran."""
    folder = FINDINGS / "lr-forecast"
    plan = json.loads((folder / "scan_plan.json").read_text())
    results = trial_results(folder)
    lines = [
        "| machine | numerics | replay of a finished trial | trials | of them at 320x2 | trial-hours |",
        "|---|---|---|---|---|---|",
    ]
    for machine in plan["machines"]:
        mine = [r for r in results if r.get("cpu") == machine["label"]]
        replay = machine.get("replay")
        replay_text = (
            "first machine"
            if not replay
            else f"{replay['trial_id']}: final loss {replay['final_loss'][0]:.4f} → {replay['final_loss'][1]:.4f}, "
            + ("bit-identical" if replay["identical"] else "differs")
        )
        at_held = sum(r["hparams"]["size"] == plan["held_out"] for r in mine)
        hours = sum(r["wall_time_s"] for r in mine) / 3600
        numerics = "its own" if machine["numerics"] == machine["label"] else machine["numerics"]
        lines.append(f"| {machine['label']} | {numerics} | {replay_text} | {len(mine)} | {at_held} | {hours:.1f} |")
    blocks = [b for c in plan["cells"] for b in c.get("machine_blocks", [])]
    text = "\n".join(lines)
    if blocks:
        text += (
            "\n\nBlocks added on a new machine: "
            + "; ".join(f"{b['machine']}: replicates {b['replicates'][0]}-{b['replicates'][1]}" for b in blocks)
            + f" (run order shuffled within each block from order seed {plan['order_seed']})."
        )
    return text


def trial_results(folder: Path) -> list[dict]:
    """The finished trials of a scan folder, from their own result.json."""
    rows = [json.loads(path.read_text()) for path in sorted(folder.glob("trials/*/result.json"))]
    return [r for r in rows if r.get("status") == "ok"]


def scan_cost(name: str) -> str:
    """Wall time per size and CPU from the trials' own result.json (median per trial and trial-hours): trials of one
    scan ran two at a time, one core each, and a CPU's times compare only with its own."""
    rows = trial_results(FINDINGS / name)
    cpus = Counter(r["cpu"] for r in rows)
    letter = {cpu: chr(ord("A") + i) for i, cpu in enumerate(sorted(cpus))}
    cells: dict[tuple, list[float]] = {}
    for r in rows:
        size = r["hparams"]["size"]
        cells.setdefault((tuple(int(x) for x in size.split("x")), size, letter[r["cpu"]]), []).append(r["wall_time_s"])
    lines = ["| size | CPU | trials | median s per trial | trial-hours |", "|---|---|---|---|---|"]
    for (_, size, cpu), times in sorted(cells.items()):
        lines.append(f"| {size} | {cpu} | {len(times)} | {statistics.median(times):.0f} | {sum(times) / 3600:.1f} |")
    total = sum(r["wall_time_s"] for r in rows) / 3600
    return "\n".join(lines) + (
        f"\n\n{len(rows)} trials, {total:.1f} trial-hours (about {total / 2:.1f} hours of two cores); CPUs: "
        + "; ".join(f"{letter[cpu]} {cpu} ({n} trials)" for cpu, n in sorted(cpus.items()))
        + "."
    )


def regime_rows(folder: Path) -> list[dict]:
    """Per size, the regime its probes trained in: parameters with and without the embedding, tokens per
    parameter, the best lr's mean final loss, the share of clipped steps (at that lr and over every lr), warmup."""
    by_size: dict[str, list[dict]] = {}
    for r in trial_results(folder):
        by_size.setdefault(r["hparams"]["size"], []).append(r)
    rows = []
    for size, trials in sorted(by_size.items(), key=lambda kv: kv[1][0]["n_params"]):
        first = trials[0]
        by_lr: dict[float, list[dict]] = {}
        for t in trials:
            by_lr.setdefault(t["hparams"]["lr"], []).append(t)
        best = min(by_lr, key=lambda lr: sum(t["final_loss"] for t in by_lr[lr]) / len(by_lr[lr]))

        def clipped(ts: list[dict]) -> float:
            return sum(t["clipped_steps"] / t["steps"] for t in ts) / len(ts)

        rows.append(
            {
                "size": size,
                "n_params": first["n_params"],
                "n_params_total": first["n_params_total"],
                "embedding_share": 1 - first["n_params"] / first["n_params_total"],
                "tokens": first["train_tokens"],
                "tokens_per_param": first["train_tokens"] / first["n_params"],
                "tokens_per_param_total": first["train_tokens"] / first["n_params_total"],
                "best_lr": best,
                "best_loss": sum(t["final_loss"] for t in by_lr[best]) / len(by_lr[best]),
                "clipped_at_best": clipped(by_lr[best]),
                "clipped_all": clipped(trials),
                "warmup_share": first["warmup_steps"] / first["steps"],
                "clip": first["hparams"]["clip"],
                "trials": len(trials),
            }
        )
    return rows


def regime(name: str) -> str:
    """The regime table of a scan folder (docs/findings/NAME), against its own unigram line."""
    folder = FINDINGS / name
    reference = json.loads((folder / "reference_lines.json").read_text())
    lines = [
        "| size | N (non-embedding) | N (with embedding) | embedding share | tokens per N (non-emb / all) | "
        "best lr | its final loss (vs unigram) | clipped steps at best lr | clipped steps, all lrs | warmup "
        "share | trials |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = regime_rows(folder)
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['n_params']:,} | {r['n_params_total']:,} | {r['embedding_share']:.0%} | "
            f"{r['tokens_per_param']:.2f} / {r['tokens_per_param_total']:.3f} | {r['best_lr']:.3g} | "
            f"{r['best_loss']:.3f} ({signed(r['best_loss'] - reference['unigram'], 2)}) | "
            f"{r['clipped_at_best']:.0%} | {r['clipped_all']:.0%} | {r['warmup_share']:.0%} | {r['trials']} |"
        )
    return "\n".join(lines) + (
        f"\n\nUnigram line on the {reference['eval_tokens']:,} validation tokens every trial "
        f"is scored on: {reference['unigram']:.2f} nats (uniform {reference['uniform']:.2f}). "
        f"Clipped: steps whose gradient norm exceeded the clip ({' / '.join(sorted({str(r['clip']) for r in rows}))}) "
        "before clipping."
    )


BLOCKS = {
    "doe20-summary": lambda: doe20_summary(doe20()),
    "doe20-calibration": lambda: doe20_calibration(doe20()),
    "doe20-effects": lambda: doe20_effects(doe20()),
    "doe20-claims": doe20_claims,
    "lr-std": lambda: lr_summary("lr-sizes-std", "Standard parametrisation"),
    "lr-mup": lambda: lr_summary("lr-sizes-mup", "muP"),
    "lr-mup-vs-std": mup_vs_std,
    "recommend-validation": recommend_validation,
    "lora-default": lambda: lora_default_table(lora_results()),
    "lora-default-summary": lora_default_summary,
    "ray-launcher": ray_launcher,
    "data-scale": data_scale,
    "data-scale-summary": data_scale_summary,
    "near-dup-quality": near_dup_quality,
    "minhash-speed": minhash_speed,
    "forecast-design": forecast_design,
    "lr-forecast": lr_forecast,
    "lr-forecast-regime": lambda: regime("lr-forecast"),
    "lr-forecast-sp-regime": lambda: regime("lr-forecast-sp"),
    "lr-forecast-mup-regime": lambda: regime("lr-forecast-mup"),
    "lr-forecast-sp-design": lambda: forecast_design("lr-forecast-sp", "chosen"),
    "lr-forecast-sp": lambda: lr_summary("lr-forecast-sp", "Second forecast, standard parametrisation"),
    "lr-forecast-sp-noise": forecast_noise,
    "lr-forecast-sp-recheck": forecast_recheck,
    "lr-forecast-mup-design": lambda: forecast_design("lr-forecast-mup", "chosen"),
    "lr-forecast-mup-design-power": forecast_design_power,
    "lr-forecast-mup-design-check": lambda: forecast_design("lr-forecast-mup", "chosen", "design_check_120.json"),
    "lr-forecast-mup": lambda: lr_summary("lr-forecast-mup", "Second forecast, muP"),
    "lr-forecast-sp-registration": lambda: registration("lr-forecast-sp"),
    "lr-forecast-mup-registration": lambda: registration("lr-forecast-mup"),
    "lr-forecast-flat-control": flat_control,
    "lr-forecast-second": second_forecasts,
    "lr-forecast-sp-cost": lambda: scan_cost("lr-forecast-sp"),
    "lr-forecast-mup-cost": lambda: scan_cost("lr-forecast-mup"),
    "lr-forecast-power": realised_power,
    "lr-forecast-machines": forecast_machines,
    "host-syncs": host_syncs,
    "near-dup-groups": near_dup_groups,
    "one-document": one_document,
    "coord-check": coord_check,
    "lr-forecast-fragility": forecast_fragility,
    "lr-forecast-fragility-short": lambda: forecast_fragility(short=True),
    "fast-path-cpu": fast_path_cpu,
}
PATTERN = re.compile(r"(<!-- findings:([\w-]+) -->\n)(.*?)(<!-- /findings:\2 -->)", re.S)


def render(text: str, cache: dict) -> str:
    def replace(match: re.Match) -> str:
        name = match.group(2)
        if name not in cache:
            cache[name] = BLOCKS[name]()
        return match.group(1) + cache[name] + "\n" + match.group(4)

    return PATTERN.sub(replace, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    args = parser.parse_args()
    cache: dict[str, str] = {}
    stale = []
    for path in DOCUMENTS:
        text = path.read_text()
        fresh = render(text, cache)
        if fresh != text:
            stale.append(str(path.relative_to(REPO)))
            if not args.check:
                path.write_text(fresh)
    if args.check and stale:
        print(f"stale generated findings in {', '.join(stale)}: run python scripts/findings.py", file=sys.stderr)
        return 1
    print(("rewrote " + ", ".join(stale)) if stale and not args.check else "findings blocks are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
