#!/usr/bin/env python
"""Every number README.md and docs/findings/README.md state about the lab, generated from the shipped results.

Each generated block sits between `<!-- findings:NAME -->` and `<!-- /findings:NAME -->` markers; this script
recomputes it from docs/findings/*/results.csv and scaling_fits.json and rewrites it in place, so prose and data
cannot drift apart. `--check` rewrites nothing and exits 1 when a block is stale (the tests run it). The blocks are
computed in scripts/findings_sections/, one module per part of the findings; this file maps names to them.

  python scripts/findings.py            # regenerate the blocks
  python scripts/findings.py --check    # fail if any block differs from the data
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from findings_sections.data import (  # noqa: E402
    data_scale,
    data_scale_summary,
    minhash_speed,
    near_dup_groups,
    near_dup_quality,
    one_document,
)
from findings_sections.doe20 import doe20, doe20_calibration, doe20_claims, doe20_effects, doe20_summary  # noqa: E402
from findings_sections.engine import coord_check, fast_path_cpu, host_syncs  # noqa: E402
from findings_sections.forecast_design import (  # noqa: E402
    flat_design_table,
    forecast_design,
    forecast_design_power,
    forecast_noise,
    forecast_recheck,
)
from findings_sections.forecast_record import forecast_fragility, forecast_machines, registration  # noqa: E402
from findings_sections.forecast_results import lr_forecast, realised_power, regime, scan_cost  # noqa: E402
from findings_sections.lora import lora_default_summary, lora_default_table, lora_results  # noqa: E402
from findings_sections.lr_sizes import flat_control, lr_summary, mup_vs_std, second_forecasts  # noqa: E402
from findings_sections.quickstart import muon_overhead, time_to_loss  # noqa: E402
from findings_sections.ray_launcher import ray_launcher  # noqa: E402
from findings_sections.recommend import recommend_validation  # noqa: E402

FINDINGS = REPO / "docs" / "findings"
DOCUMENTS = (
    REPO / "README.md",
    FINDINGS / "README.md",
    *(REPO / "docs" / f"{name}.md" for name in ("usage", "data", "lab")),
    FINDINGS / "lr-forecast-sp" / "forecast_design.md",
    FINDINGS / "lr-forecast-mup" / "forecast_design.md",
    FINDINGS / "lr-forecast-gpt2" / "forecast_design.md",
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
    "lr-forecast-gpt2": lambda: lr_summary("lr-forecast-gpt2", "Third forecast, GPT-2 probes under muP"),
    "lr-forecast-gpt2-candidates": flat_design_table,
    "quickstart-time-to-loss": time_to_loss,
    "muon-overhead": muon_overhead,
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
