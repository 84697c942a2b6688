"""What a smoke trial costs at the smoke budget's 64x2 minimal model against the model's own 192x4.

One sweep (`--budget smoke`, one worker of one thread, the default forkserver launcher) runs the two shapes
alternating, trial by trial, so both see the same machine load; each trial's wall time is its own (result.json,
process start to result). Prints the median per shape and the ratio against 192x4, the baseline.

    python bench/smoke_shape.py --pairs 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASELINE, SMOKE = "192x4", "64x2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=6, help="trials per shape, run alternating")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from llmlab.core.runinfo import machine_label

    with tempfile.TemporaryDirectory() as tmp:
        grid = Path(tmp) / "grid.yaml"
        trials = [
            f"  - {{trial_id: {shape}-{i}, size: {shape}}}" for i in range(args.pairs) for shape in (BASELINE, SMOKE)
        ]
        grid.write_text("trials:\n" + "\n".join(trials) + "\n")
        out = Path(tmp) / "sweep"
        command = [sys.executable, "sweep.py", "--budget", "smoke", "--grid", str(grid), "--workers", "1"]
        command += ["--threads_per_worker", "1", "--output_dir", str(out)]
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            sys.exit(proc.stderr[-3000:])
        walls = {BASELINE: [], SMOKE: []}
        for result in (out / "trials").glob("*/result.json"):
            row = json.loads(result.read_text())
            walls[row["trial_id"].split("-")[0]].append(row["wall_time_s"])
    base = statistics.median(walls[BASELINE])
    print(f"smoke budget, {args.pairs} trials per shape, alternating; {machine_label()}")
    print("| shape | trials | median s per trial | range | vs 192x4 |")
    print("|---|---|---|---|---|")
    for shape, times in walls.items():
        median = statistics.median(times)
        print(f"| {shape} | {len(times)} | {median:.2f} | {min(times):.2f}-{max(times):.2f} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
