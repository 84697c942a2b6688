"""What every findings section shares: the repo's folders, number formats, and readers of the shipped results."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FINDINGS = REPO / "docs" / "findings"
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


def lr_scan(name: str) -> dict | None:
    path = FINDINGS / name / "scaling_fits.json"
    return json.loads(path.read_text())["transfer"] if path.is_file() else None


def _ci_text(verdict: dict) -> str:
    """A verdict's intervals of R = forecast / measured, as every findings sentence states them."""
    return (
        f"(90 % CI [{verdict['ci90'][0]:.2f}, {verdict['ci90'][1]:.2f}], 95 % CI [{verdict['ci95'][0]:.2f}, "
        f"{verdict['ci95'][1]:.2f}], {verdict['df']} df)"
    )


def _verdict_text(verdict: dict) -> str:
    return f"**{verdict['verdict']}**, R = {verdict['ratio']:.2f} {_ci_text(verdict)}"


def quoted(answer: str, limit: int = 60) -> str:
    """A generated answer on one line, as JSON would quote it, cut to `limit` characters."""
    text = json.dumps(answer, ensure_ascii=False)
    return f"`{text[:limit]}…`" if len(text) > limit else f"`{text}`"


def _paired(row: dict, base: dict) -> str:
    """row / base round by round (the runs of one round ran back to back): median and range."""
    ratios = [a / b for a, b in zip(row["rounds"], base["rounds"])]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


POWER = "power: P(95 % CI excludes 1 | 1.5x miss)"


def worst_judged_power(row: dict, judged: list[str]) -> tuple[float, str]:
    """A design's power in its least favourable judged world, and that world."""
    return min((row[world][POWER], world) for world in judged)


def _ratio_text(row: dict) -> str:
    return (
        f"forecast / measured = **{row['ratio']:.2f}** {_ci_text(row)}, measured lr_opt "
        f"{row['measured']:.3g} [{row['measured_ci'][0]:.3g}, {row['measured_ci'][1]:.3g}]"
    )


def trial_results(folder: Path) -> list[dict]:
    """The finished trials of a scan folder, from their own result.json."""
    rows = [json.loads(path.read_text()) for path in sorted(folder.glob("trials/*/result.json"))]
    return [r for r in rows if r.get("status") == "ok"]
