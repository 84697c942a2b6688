"""recommend's validation: its lr against each target's measured optimum."""

from __future__ import annotations

import json

from findings_sections.common import FINDINGS, interval, signed
from llmlab.scaling.optimum import cell_optimum, pure_error


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
