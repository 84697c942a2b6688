"""The registered forecasts' record: registrations, their timing, fragility, machines."""

from __future__ import annotations

import json
import math

from findings_sections.common import FINDINGS, trial_results
from llmlab.core.identity import file_sha256


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
