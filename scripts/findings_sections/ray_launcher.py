"""The Ray launcher's measurements."""

from __future__ import annotations

import json

from findings_sections.common import FINDINGS


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
