#!/usr/bin/env python
"""The lab's probe at the cpu budget: does it learn, how noisy is it, and how fast is a trial?

Runs the doe20 control (cosine, clip 1.0, warmup 500 -> 55 steps, wd 0.01, AdamW, lr 1e-3; 200 steps of
4 x 128 tokens on builtin:wiki) with --seeds seeds in four configurations, through `sweep.py` itself:

  legacy     frozen tied embedding + sinusoidal positions, fp32, no compile: the original lab, as it ran
  sinusoidal trainable embedding + sinusoidal positions, precision auto + compile
  fp32       the new default probe (trainable embedding + RoPE), fp32, no compile: today's trial code path
  default    the new default probe, precision auto (bf16 autocast on this CPU) + torch.compile

Configurations run two at a time, paired so that each speed comparison is side by side on the same machine
(legacy with sinusoidal, fp32 with default), one worker of one thread each: a 2-core box fully used, as the
README's doe20 command uses it. Prints final validation loss (mean, seed SD) against the uniform guess and an
add-one unigram model evaluated on the same validation rows, attention entropy, and median tokens/s, with the speed
ratios and the loss difference of the fast path with its 95 % CI. Writes bench_probe.json in --out.

  python bench/sweep_probe.py                       # ~25 minutes on 2 cores
  python bench/sweep_probe.py --seeds 2 --only fp32 default
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmlab.sweep.config import BUDGETS  # noqa: E402
from llmlab.sweep.metrics import reference_lines  # noqa: E402

CONFIGS = {
    "legacy": ["--embedding", "frozen", "--position_encoding", "sinusoidal", "--precision", "fp32", "--no-compile"],
    "sinusoidal": ["--position_encoding", "sinusoidal"],
    "fp32": ["--precision", "fp32", "--no-compile"],
    "default": [],
}
PAIRS = [("legacy", "sinusoidal"), ("fp32", "default")]


def run_pair(names: list[str], seeds: int, out: Path) -> None:
    grid = out / "control.yaml"
    grid.write_text(f"replicates: {seeds}\ntrials:\n  - {{trial_id: control}}\n")
    procs = []
    for name in names:
        cmd = [
            sys.executable,
            "sweep.py",
            "--budget",
            "cpu",
            "--grid",
            str(grid),
            "--workers",
            "1",
            "--threads_per_worker",
            "1",
            "--output_dir",
            str(out / name),
            *CONFIGS[name],
        ]
        log = open(out / f"{name}.log", "w")
        procs.append((name, subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log))
    for name, proc, log in procs:
        if proc.wait() != 0:
            raise SystemExit(f"{name}: sweep.py failed; see {out / (name + '.log')}")
        log.close()


def summarise(name: str, out: Path) -> dict:
    with open(out / name / "results.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["status"] == "ok"]
    losses = [float(r["final_loss"]) for r in rows]
    return {
        "config": name,
        "runs": len(rows),
        "losses": losses,
        "mean": sum(losses) / len(losses),
        "sd": _sd(losses),
        "entropy": _median(float(r["attention_entropy_last_layer"]) for r in rows),
        "tokens_per_s": _median(float(r["tokens_per_s"]) for r in rows),
        "trial_s": _median(float(r["wall_time_s"]) for r in rows),
        "precision": rows[0]["precision"],
        "compiled": rows[0]["compiled"],
    }


def _median(values) -> float:
    values = sorted(values)
    return (
        values[len(values) // 2] if len(values) % 2 else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2
    )


def _sd(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else float("nan")


def difference(a: dict, b: dict) -> str:
    """Welch 95 % CI of mean(b) - mean(a)."""
    from scipy import stats

    result = stats.ttest_ind(b["losses"], a["losses"], equal_var=False)
    ci = result.confidence_interval(0.95)
    return f"{b['mean'] - a['mean']:+.3f} nats, 95% CI [{ci.low:+.3f}, {ci.high:+.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="runs per configuration (default 3)")
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), help="run only these configurations")
    parser.add_argument("--out", default="runs/bench_probe", help="folder for the sweeps and bench_probe.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = args.only or list(CONFIGS)
    started = time.time()
    for pair in PAIRS:
        names = [n for n in pair if n in wanted]
        if names:
            run_pair(names, args.seeds, out)
    rows = [summarise(name, out) for name in wanted]
    ref = reference_lines(out / wanted[0] / "data", BUDGETS["cpu"].eval_batches * BUDGETS["cpu"].batch_size)
    unigram = ref["unigram"]
    print(
        f"\nProbe at the cpu budget, {args.seeds} seeds each ({time.time() - started:.0f} s in all). Reference "
        f"lines on the {ref['eval_tokens']:,} tokens trials are scored on: uniform {ref['uniform']:.2f}, "
        f"add-one unigram {unigram:.2f} nats."
    )
    print(
        f"{'config':<11} {'precision':<9} {'compile':<7} {'final loss':>16} {'vs unigram':>10} "
        f"{'attn entropy':>12} {'tokens/s':>9} {'trial s':>8}"
    )
    for r in rows:
        print(
            f"{r['config']:<11} {r['precision']:<9} {r['compiled']:<7} {r['mean']:>8.3f} ± {r['sd']:.3f}  "
            f"{r['mean'] - unigram:>+10.2f} {r['entropy']:>12.3f} {r['tokens_per_s']:>9.0f} {r['trial_s']:>8.0f}"
        )
    by = {r["config"]: r for r in rows}
    if {"fp32", "default"} <= set(by):
        print(
            f"default vs fp32 (same model, side by side): "
            f"{by['default']['tokens_per_s'] / by['fp32']['tokens_per_s']:.2f}x "
            f"tokens/s; final loss {difference(by['fp32'], by['default'])}"
        )
    if {"legacy", "default"} <= set(by):
        print(
            f"default vs legacy trial: {by['default']['tokens_per_s'] / by['legacy']['tokens_per_s']:.2f}x tokens/s "
            f"(the default trains 9.6M more parameters); final loss {difference(by['legacy'], by['default'])}"
        )
    (out / "bench_probe.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
