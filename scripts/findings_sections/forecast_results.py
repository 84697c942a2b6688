"""The registered forecasts' results: verdicts, realised power, cost and regime."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

from findings_sections.common import FINDINGS, _ratio_text, signed, trial_results
from findings_sections.forecast_design import sigma_study_before_registration
from llmlab.core.identity import file_sha256


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
