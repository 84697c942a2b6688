#!/usr/bin/env python
"""End to end: scan small GPT-2s, recommend a config for a bigger one, train it, and check the recommendation.

1. `sweep.py --grid lr_bs --model gpt2-tiny --sizes ...` scans lr x batch at small widths/depths of the GPT-2
   family (the joint fit ln lr_opt = k0 + a ln N + b ln B, held-out check on the largest size).
2. `sweep.py recommend --params N --tokens D` proposes a config for the target size (default gpt2-tiny, 256x4),
   larger than any scanned size.
3. `train_pretrain.py` (the README's command) trains the target at the same D tokens with
     recommended  the YAML as written
     default      train_pretrain.py's own defaults for the target, max_steps set for D tokens
     grid lr=...  the recommended YAML with the lr replaced, for a small grid (the best of it is the reference)
   two runs at a time, one thread each (losses do not depend on the thread count).

Prints the validation loss of each at equal tokens, the gap to the best grid run, and recommended lr / best
grid lr. Everything lands in --out; rerunning reuses finished scan trials and training runs.

    python bench/recommend_validation.py                         # ~1 h on 2 cores
    python bench/recommend_validation.py --sizes 64x2 128x2 --batch_sizes 4 --tokens 200000   # ~25 min
"""
from __future__ import annotations

import argparse
import json
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
    """One train_pretrain.py run (skipped when its metrics already hold a final validation loss)."""
    from llmlab.core.io import read_jsonl

    metrics = out / "metrics.jsonl"
    if not (out / "final").is_dir():
        cmd = [sys.executable, "train_pretrain.py", *flags, "--output_dir", str(out), "--overwrite_output_dir",
               "--cpu_threads", "1", "--save_every", "1000000", "--eval_every", "0", "--eval_batches", "40",
               "--sample_tokens", "0"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return [r for r in read_jsonl(metrics) if "val/loss" in r][-1]["val/loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/recommend_validation")
    parser.add_argument("--sizes", nargs="+", default=["64x2", "128x2", "192x2"])
    parser.add_argument("--batch_sizes", nargs="+", default=["4", "8"])
    parser.add_argument("--target", default="256x4", help="WIDTHxDEPTH of the target (256x4 = gpt2-tiny)")
    parser.add_argument("--tokens", type=int, default=400_000, help="training tokens of every target run")
    parser.add_argument("--memory_gb", type=float, default=8.0, help="memory budget given to recommend")
    parser.add_argument("--grid", nargs="+", type=float, default=[3e-4, 1e-3, 3e-3], help="lr grid at the target")
    args = parser.parse_args()
    out = Path(args.out)
    subprocess.run([sys.executable, "sweep.py", "--grid", "lr_bs", "--budget", "cpu", "--model", "gpt2-tiny",
                    "--sizes", *args.sizes, "--batch_sizes", *args.batch_sizes, "--workers", "2",
                    "--output_dir", str(out / "scan")], cwd=REPO, check=True)
    n_target = target_params(args.target)
    recommended = out / "recommended.yaml"
    subprocess.run([sys.executable, "sweep.py", "recommend", "--from", str(out / "scan"), "--params", str(n_target),
                    "--tokens", str(args.tokens), "--memory-gb", str(args.memory_gb), "--output", str(recommended)],
                   cwd=REPO, check=True)
    rec = yaml.safe_load(recommended.read_text())
    width, depth = (int(v) for v in args.target.split("x"))
    shape = ["--model", "gpt2-tiny", "--n_embd", str(width), "--n_layer", str(depth), "--n_head", str(width // 64)]
    default_steps = max(1, args.tokens // (8 * 128))  # gpt2-tiny's default batch 8 x block 128
    runs = {"recommended": (rec["learning_rate"], rec["batch_size"], [*shape, "--config", str(recommended)]),
            "default": (None, 8, [*shape, "--max_steps", str(default_steps)])}
    for lr in args.grid:
        runs[f"grid lr={lr:g}"] = (lr, rec["batch_size"], [*shape, "--config", str(recommended),
                                                           "--learning_rate", str(lr), "--min_lr", str(lr / 10)])
    with ThreadPoolExecutor(2) as pool:
        losses = dict(zip(runs, pool.map(lambda item: train(out / item[0].replace(" ", "_").replace("=", ""),
                                                                  item[1][2]), runs.items())))
    default_config = yaml.safe_load((out / "default" / "config.yaml").read_text())
    runs["default"] = (default_config["learning_rate"], *runs["default"][1:])  # train_pretrain.py's own default
    grid = {name: loss for name, loss in losses.items() if name.startswith("grid")}
    best = min(grid, key=grid.get)
    print(f"\ntarget {args.target}: N = {n_target:,} non-embedding params "
          f"({n_target / max(_scanned_params(out / 'scan')):.1f}x the largest scanned); {args.tokens:,} tokens per run")
    print("\n| config | lr | batch | val loss | vs best grid run |")
    print("|---|---|---|---|---|")
    for name, (lr, batch, _) in runs.items():
        print(f"| {name} | {lr:.3g} | {batch} | {losses[name]:.4f} | {losses[name] - grid[best]:+.4f} |")
    best_lr = runs[best][0]
    print(f"\nrecommended lr / best grid lr = {rec['learning_rate'] / best_lr:.2f}; "
          f"default lr / best grid lr = {runs['default'][0] / best_lr:.2f}")
    (out / "validation.json").write_text(json.dumps({"losses": losses, "runs": {k: v[:2] for k, v in runs.items()},
                                                     "n_target": n_target, "tokens": args.tokens}, indent=1))


def _scanned_params(scan: Path) -> list[float]:
    import csv

    with open(scan / "results.csv") as f:
        return [float(r["n_params"]) for r in csv.DictReader(f) if r.get("n_params")]


if __name__ == "__main__":
    main()
