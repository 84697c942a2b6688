#!/usr/bin/env python
"""Sweep launcher overhead: what a trial pays for its own process, and what a second worker buys.

Runs the same small trials (smoke-sized minimal Transformer, real data) three ways, side by side:
  spawn  x1 worker  -- `python -m llmlab.sweep.trial spec.json` per trial: the baseline
  fork   x1 worker  -- forked from a server that imported only the trial module (before: each trial then imported
                       torch._dynamo and tensorboard itself)
  fork   x1 worker  -- forked from a server that also preloaded those (the default)
  fork   x2 workers -- the same trials, two at a time
Every trial uses one CPU thread so the worker comparison is about processes, not threads
(--auto_threads adds the 1-worker run with all cores' threads). Overhead per trial = launch-to-exit time seen
by the parent minus the trial's own work after loading
its data (process start + imports + memory-mapping the prepared data). Prints a table with ratios.

  python bench/sweep_overhead.py                 # ~3 minutes on 2 cores
  python bench/sweep_overhead.py --trials 8 --steps 30
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run_batch(specs, launcher_name: str, workers: int, tag: str, threads: int = 1) -> dict:
    from llmlab.sweep.launchers.local import TrialLauncher

    launcher = TrialLauncher(launcher_name, workers, threads)
    specs = [replace(s, trial_dir=str(Path(s.trial_dir).with_name(f"{tag}_{Path(s.trial_dir).name}"))) for s in specs]
    seen = []

    def one(args):
        index, spec = args
        tick = time.perf_counter()
        result = launcher.run(spec, index % workers)
        elapsed = time.perf_counter() - tick
        work = result["wall_time_s"] - result.get("startup_s", 0.0)  # trial's own work after its data loaded
        seen.append({"elapsed": elapsed, "overhead": elapsed - work, "status": result["status"]})

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, enumerate(specs)))
    wall = time.perf_counter() - start
    if any(s["status"] != "ok" for s in seen):
        raise SystemExit(f"{tag}: a trial did not finish ok: {[s['status'] for s in seen]}")
    overhead = sum(s["overhead"] for s in seen) / len(seen)
    per_trial = sum(s["elapsed"] for s in seen) / len(seen)
    return {
        "tag": f"{tag} ({launcher.threads}t)",
        "trials": len(seen),
        "wall": wall,
        "throughput": 60 * len(seen) / wall,
        "overhead": overhead,
        "per_trial": per_trial,
        "share": overhead / per_trial,
    }


def trial_module_only(specs) -> dict:
    """The same trials from a fork server that preloads the trial module only, then the default server back."""
    from multiprocessing import forkserver

    from llmlab.sweep.launchers import local

    default = local.FORKSERVER_PRELOAD
    forkserver._forkserver._stop()
    local._FORKSERVER, local.FORKSERVER_PRELOAD = None, ["llmlab.sweep.trial"]
    try:
        return run_batch(specs, "forkserver", 1, "fork x1 module")
    finally:
        forkserver._forkserver._stop()
        local._FORKSERVER, local.FORKSERVER_PRELOAD = None, default
        local.forkserver_context()


def main() -> None:
    # long: options, then each launcher timed in turn and the table, in the order they run
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=4, help="trials per configuration (default 4)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per trial (default 8)")
    parser.add_argument(
        "--auto_threads",
        action="store_true",
        help="also run 1 worker with all cores' threads (the sweep's default for --workers 1)",
    )
    parser.add_argument("--output_dir", default=None, help="work folder (default: a temporary one)")
    args = parser.parse_args()

    from llmlab.sweep import runner
    from llmlab.sweep.config import SweepConfig
    from llmlab.sweep.design import build_design
    from llmlab.sweep.launchers.local import forkserver_context

    out = Path(args.output_dir or tempfile.mkdtemp(prefix="sweep_overhead_"))
    cfg = SweepConfig(grid="doe20", budget="smoke", output_dir=str(out), steps=args.steps, device="cpu").resolved()
    tick = time.perf_counter()
    data_info = runner.prepare_data(cfg, out)
    prepare_s = time.perf_counter() - tick
    specs = runner.trial_specs(cfg, build_design(cfg)[: args.trials], data_info, out)

    tick = time.perf_counter()
    probe = forkserver_context().Process(target=os.getpid)  # returns once the server has preloaded
    probe.start()
    probe.join()
    forkserver_s = time.perf_counter() - tick
    rows = [run_batch(specs, "spawn", 1, "spawn x1"), trial_module_only(specs)]
    rows += [run_batch(specs, "forkserver", 1, "fork x1"), run_batch(specs, "forkserver", 2, "fork x2")]
    if args.auto_threads:
        rows.append(run_batch(specs, "forkserver", 1, "fork x1", threads=0))

    print(
        f"\ndata prepared once in the parent: {prepare_s:.1f} s ({data_info['train_rows']} train blocks of "
        f"{data_info['block_size']}); fork server start with torch/transformers preloaded (once per "
        f"sweep): {forkserver_s:.1f} s"
    )
    print(f"{args.trials} trials x {args.steps} steps each, minimal Transformer, batch 2 x 32 tokens\n")
    header = (
        f"{'launcher':<20} {'trials':>6} {'wall s':>8} {'trials/min':>10} {'s/trial':>8} "
        f"{'overhead s':>10} {'overhead share':>14}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['tag']:<20} {r['trials']:>6} {r['wall']:>8.1f} {r['throughput']:>10.2f} {r['per_trial']:>8.2f} "
            f"{r['overhead']:>10.2f} {100 * r['share']:>13.1f}%"
        )
    spawn, before, fork1, fork2 = rows[:4]
    print(
        f"trials/min, server preloads what trials import / the trial module only: "
        f"{fork1['throughput'] / before['throughput']:.2f}x ({before['per_trial'] - fork1['per_trial']:.2f} s a trial)"
    )
    print(f"\noverhead per trial, spawn / fork server: {spawn['overhead'] / max(fork1['overhead'], 1e-9):.1f}x")
    print(
        f"throughput, 2 workers / 1 worker (fork server, 1 thread per trial): "
        f"{fork2['throughput'] / fork1['throughput']:.2f}x"
    )


if __name__ == "__main__":
    main()
