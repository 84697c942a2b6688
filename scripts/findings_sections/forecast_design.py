"""The registered forecasts' designs: simulated power, the noise they were chosen from, rechecks."""

from __future__ import annotations

import json
import math

from findings_sections.common import FINDINGS, trial_results, worst_judged_power


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


FLAT_POWER, FLAT_WITHIN = "flat: P(95 % CI excludes 1 | 1.5x miss)", "flat: P(within | exact)"


def flat_design_table(name: str = "lr-forecast-gpt2") -> str:
    """Every candidate of a muP scan judged on its flat forecast: trials, trial-hours, and the flat forecast's power
    and P(within | exact) in each judged world (design_candidates.json), the registered design marked."""
    data = json.loads((FINDINGS / name / "design_candidates.json").read_text())
    chosen = json.loads((FINDINGS / name / "design_rationale.json").read_text())["chosen"]
    judged, hours = data["judged_on"], data["trial_hours"]
    lines = [
        "| design | trials | trial-hours | flat: power for a 1.5x miss | flat: P(within 1.5x, exact) |",
        "|---|---|---|---|---|",
    ]
    for label, row in data["designs"].items():
        power = " / ".join(f"{row[w][FLAT_POWER]:.0%}" for w in judged)
        within = " / ".join(f"{row[w][FLAT_WITHIN]:.0%}" for w in judged)
        mark = "**" if label == chosen else ""
        lines.append(f"| {mark}{label}{mark} | {row['trials']} | {hours['hours'][label]} | {power} | {within} |")
    return (
        "\n".join(lines)
        + f"\n\nEach cell: {' / '.join(judged)}; {data['reps']} simulated scans per design, world and miss. Hours: "
        f"the whole design on 2 cores, fit stage included, priced by {hours['priced_by']}."
    )
