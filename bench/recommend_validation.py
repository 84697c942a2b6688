#!/usr/bin/env python
"""End to end: scan small GPT-2s, recommend a config for a bigger one, train it, and check the recommendation.

1. `sweep.py --grid lr_bs --model gpt2-tiny --sizes ...` runs the adaptive multi-size lr scan (2 seeds per lr) at
   small widths/depths of the GPT-2 family: lr_opt per size with its interval, the law across sizes.
2. `sweep.py recommend --params N --tokens D --effective_batch_size B` proposes a config for the target size
   (default gpt2-tiny, 256x4), larger than any scanned size.
3. `train_pretrain.py` (the README's command) trains the target at the same D tokens and batch, --seeds times each:
     recommended  the YAML as written
     default      train_pretrain.py's own defaults for the target
     grid lr=...  the recommended YAML with the lr replaced, over a sqrt(2)-spaced grid
   two runs at a time, one thread each (losses do not depend on the thread count).

Prints every configuration's mean validation loss at equal tokens and recommended - best grid run with its 95 % CI
(t on the pooled seed SD of all configurations; the best grid lr is picked by the same runs, so the gap is biased
towards the grid). Everything lands in --out; rerunning reuses finished scan trials and training runs.

    python bench/recommend_validation.py          # about 1.5 h on 2 cores
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def target_params(size: str) -> int:
    """Non-embedding N of the target GPT-2 (what the scan records and the fit uses)."""
    from llmlab.models.gpt2 import build_gpt2_model

    width, depth = (int(v) for v in size.split("x"))
    model = build_gpt2_model("gpt2-tiny", n_embd=width, n_layer=depth, n_head=width // 64)
    return model.num_parameters(exclude_embeddings=True)


def train(out: Path, flags: list[str]) -> float:
    """One train_pretrain.py run (skipped when it already finished); its last validation loss."""
    from llmlab.core.io import read_jsonl

    if not (out / "final").is_dir():
        cmd = [
            sys.executable,
            "train_pretrain.py",
            *flags,
            "--output_dir",
            str(out),
            "--overwrite_output_dir",
            "--cpu_threads",
            "1",
            "--save_every",
            "1000000",
            "--eval_every",
            "0",
            "--eval_batches",
            "40",
            "--sample_tokens",
            "0",
        ]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return [r for r in read_jsonl(out / "metrics.jsonl") if "val/loss" in r][-1]["val/loss"]


def comparison(losses: dict[str, list[float]], a: str, b: str) -> dict:
    """mean(a) - mean(b) with a 95 % CI from the seed SD pooled over every configuration."""
    from scipy import stats

    ss = sum(sum((x - sum(v) / len(v)) ** 2 for x in v) for v in losses.values())
    df = sum(len(v) - 1 for v in losses.values())
    sd = math.sqrt(ss / df)
    diff = sum(losses[a]) / len(losses[a]) - sum(losses[b]) / len(losses[b])
    half = stats.t.ppf(0.975, df) * sd * math.sqrt(1 / len(losses[a]) + 1 / len(losses[b]))
    return {"difference": diff, "ci": [diff - half, diff + half], "seed_sd": sd, "df": df}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/recommend_validation")
    parser.add_argument("--sizes", nargs="+", default=["64x2", "128x2", "192x2"])
    parser.add_argument("--lr_points", type=int, default=5, help="lrs per scanned size")
    parser.add_argument("--target", default="256x4", help="WIDTHxDEPTH of the target (256x4 = gpt2-tiny)")
    parser.add_argument("--tokens", type=int, default=200_000, help="training tokens of every target run")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step of every target run")
    parser.add_argument(
        "--grid", nargs="+", type=float, default=[1e-3, 1.41e-3, 2e-3, 2.83e-3, 4e-3], help="lr grid at the target"
    )
    parser.add_argument("--seeds", type=int, default=2, help="runs per configuration")
    return parser.parse_args()


def scan_and_recommend(args, out: Path) -> tuple[Path, int]:
    """The lr scan of the small GPT-2s, then recommend's YAML for the target: its path and the target's N."""
    scan = ["--grid", "lr_bs", "--budget", "cpu", "--model", "gpt2-tiny", "--sizes", *args.sizes]
    scan += ["--lr_points", str(args.lr_points), "--workers", "2", "--output_dir", str(out / "scan")]
    subprocess.run([sys.executable, "sweep.py", *scan], cwd=REPO, check=True)
    n_target = target_params(args.target)
    recommended = out / "recommended.yaml"
    width, depth = (int(v) for v in args.target.split("x"))
    ask = ["--from", str(out / "scan"), "--params", str(n_target), "--n_layer", str(depth), "--n_embd", str(width)]
    ask += ["--tokens", str(args.tokens), "--seq_len", "128", "--effective_batch_size", str(args.batch)]
    ask += ["--memory-gb", "8", "--output", str(recommended)]
    subprocess.run([sys.executable, "sweep.py", "recommend", *ask], cwd=REPO, check=True)
    return recommended, n_target


def target_configs(args, rec: dict, recommended: Path) -> dict:
    """name -> (lr, train_pretrain.py flags) of every configuration trained at the target."""
    width, depth = (int(v) for v in args.target.split("x"))
    shape = ["--model", "gpt2-tiny", "--n_embd", str(width), "--n_layer", str(depth), "--n_head", str(width // 64)]
    shape += ["--batch_size", str(args.batch), "--effective_batch_size", str(args.batch)]
    steps = ["--max_steps", str(args.tokens // (args.batch * 128))]
    configs = {
        "recommended": (rec["learning_rate"], [*shape, "--config", str(recommended)]),
        "default": (None, ["--model", "gpt2-tiny", *steps]),
    }
    for lr in args.grid:
        configs[f"grid lr={lr:g}"] = (
            lr,
            [*shape, "--config", str(recommended), "--learning_rate", str(lr), "--min_lr", str(lr / 10)],
        )
    return configs


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    recommended, n_target = scan_and_recommend(args, out)
    rec = yaml.safe_load(recommended.read_text())
    configs = target_configs(args, rec, recommended)
    jobs = [(name, seed) for name in configs for seed in range(args.seeds)]

    def run(job):
        name, seed = job
        folder = out / f"{name.replace(' ', '_').replace('=', '')}_seed{seed}"
        return train(folder, [*configs[name][1], "--seed", str(42 + seed)])

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, jobs))
    losses: dict[str, list[float]] = {}
    for (name, _), loss in zip(jobs, results):
        losses.setdefault(name, []).append(loss)
    default_lr = yaml.safe_load((out / "default_seed0" / "config.yaml").read_text())["learning_rate"]
    configs["default"] = (default_lr, configs["default"][1])
    report(args, rec, configs, losses, n_target, out)


def report(args, rec: dict, configs: dict, losses: dict, n_target: int, out: Path) -> None:
    mean = {name: sum(v) / len(v) for name, v in losses.items()}
    grid = {name: m for name, m in mean.items() if name.startswith("grid")}
    best = min(grid, key=grid.get)
    versus = comparison(losses, "recommended", best)
    default = comparison(losses, "default", best)
    print(f"\ntarget {args.target}: N = {n_target:,}; {args.tokens:,} tokens per run, {args.seeds} seeds each")
    print("\n| config | lr | val loss (mean of seeds) | seeds |")
    print("|---|---|---|---|")
    for name, (lr, _) in configs.items():
        print(f"| {name} | {lr:.3g} | {mean[name]:.4f} | {', '.join(f'{x:.4f}' for x in losses[name])} |")
    print(
        f"\nrecommended - best grid ({best}): {versus['difference']:+.4f} [{versus['ci'][0]:+.4f}, "
        f"{versus['ci'][1]:+.4f}] (seed SD {versus['seed_sd']:.4f}, {versus['df']} df); default - best grid: "
        f"{default['difference']:+.4f} [{default['ci'][0]:+.4f}, {default['ci'][1]:+.4f}]; recommended lr / best "
        f"grid lr = {rec['learning_rate'] / configs[best][0]:.2f}"
    )
    (out / "validation.json").write_text(
        json.dumps(
            {
                "losses": losses,
                "lrs": {k: v[0] for k, v in configs.items()},
                "n_target": n_target,
                "tokens": args.tokens,
                "batch": args.batch,
                "best_grid": best,
                "recommended_minus_best": versus,
                "default_minus_best": default,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
