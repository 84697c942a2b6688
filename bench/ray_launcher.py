#!/usr/bin/env python
"""sweep.py --launcher ray against the local launcher: overhead per trial, and what a second node buys.

1. Overhead: the same smoke trials (minimal Transformer, real data, one CPU thread each) one at a time through
   the local fork server, local fresh interpreters (spawn) and a one-node Ray cluster with 1 CPU. Overhead per
   trial = launch-to-result time seen by the driver minus the trial's own work after loading its data.
2. Speedup: a cpu-budget lr scan (4 learning rates, 200 steps each) run end to end by `sweep.py --launcher ray`
   on a cluster of 1 node x 1 CPU, then of 2 nodes x 1 CPU (one process per node; on one host each node gets its
   own core). Same trials, same seeds; the ratio of wall times is the speedup.

Ray runs on this host only, bound to 127.0.0.1. Prints both tables; --output writes them as JSON.

  python bench/ray_launcher.py                    # ~15 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only (docs: ../shared/platform-facts.md)

from llmlab.sweep import runner  # noqa: E402
from llmlab.sweep.config import SweepConfig  # noqa: E402
from llmlab.sweep.design import build_design  # noqa: E402
from llmlab.sweep.launchers.local import TrialLauncher, forkserver_context  # noqa: E402

SCAN = [
    "--grid",
    "lr_bs",
    "--budget",
    "cpu",
    "--lrs",
    "1e-3",
    "2e-3",
    "3e-3",
    "4e-3",
    "--batch_sizes",
    "4",
    "--launcher",
    "ray",
    "--cpus_per_trial",
    "1",
]


def overhead_row(name: str, launcher, specs) -> dict:
    seen = []
    for spec in specs:
        spec = replace(spec, trial_dir=str(Path(spec.trial_dir).with_name(f"{name}_{Path(spec.trial_dir).name}")))
        tick = time.perf_counter()
        result = launcher.run(spec, 0)
        elapsed = time.perf_counter() - tick
        if result["status"] != "ok":
            raise SystemExit(f"{name}: trial {spec.trial_id} ended {result['status']}: {result.get('failures')}")
        seen.append((elapsed, elapsed - (result["wall_time_s"] - result.get("startup_s", 0.0))))
    elapsed = sorted(e for e, _ in seen)
    overheads = sorted(o for _, o in seen)
    return {
        "launcher": name,
        "trials": len(seen),
        "median_s_per_trial": elapsed[len(elapsed) // 2],
        "median_overhead_s": overheads[len(overheads) // 2],
    }


def overheads(cluster, out: Path, trials: int) -> list[dict]:
    from llmlab.sweep.launchers.ray import RayLauncher

    cfg = SweepConfig(grid="doe20", budget="smoke", output_dir=str(out), device="cpu").resolved()
    data_info = runner.prepare_data(cfg, out)
    specs = runner.trial_specs(cfg, build_design(cfg)[:trials], data_info, out)
    forkserver_context()
    ray_launcher = RayLauncher(cluster.address, out / "data", cpus_per_trial=1)
    ray_launcher.run(specs[0], 0)  # the first task starts a Ray worker and ships llmlab: once per sweep
    rows = [
        overhead_row("fork server", TrialLauncher("forkserver", 1, 1), specs),
        overhead_row("spawn", TrialLauncher("spawn", 1, 1), specs),
        overhead_row("ray, 1 node", ray_launcher, specs),
    ]
    import ray

    ray.shutdown()
    return rows


def timed_scan(address: str, out: Path, cache: Path) -> float:
    tick = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "sweep.py",
            *SCAN,
            "--ray_address",
            address,
            "--output_dir",
            str(out),
            "--data_cache_dir",
            str(cache),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return time.perf_counter() - tick


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=6, help="smoke trials per launcher in the overhead table")
    parser.add_argument("--output", default=None, help="also write the tables as JSON here")
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    work = Path(tempfile.mkdtemp(prefix="ray_bench_"))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        rows = overheads(cluster, work / "overhead", args.trials)
        one = timed_scan(cluster.address, work / "one_node", work / "cache")
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        two = timed_scan(cluster.address, work / "two_nodes", work / "cache")
    finally:
        cluster.shutdown()
    fork = rows[0]["median_overhead_s"]
    print(f"\n1. Overhead per trial ({args.trials} smoke trials each, one at a time, 1 CPU thread; medians)\n")
    print("| launcher | s per trial | overhead s | overhead / fork server's |\n|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['launcher']} | {row['median_s_per_trial']:.2f} | {row['median_overhead_s']:.2f} | "
            f"{row['median_overhead_s'] / fork:.1f}x |"
        )
    print("\n2. cpu-budget lr scan, 4 trials x 200 steps, sweep.py --launcher ray end to end\n")
    print(
        f"| cluster | wall s | speedup |\n|---|---|---|\n| 1 node x 1 CPU | {one:.0f} | 1.00x |\n"
        f"| 2 nodes x 1 CPU | {two:.0f} | {one / two:.2f}x |"
    )
    if args.output:
        Path(args.output).write_text(
            json.dumps({"overhead": rows, "scan_one_node_s": one, "scan_two_nodes_s": two}, indent=1)
        )


if __name__ == "__main__":
    main()
