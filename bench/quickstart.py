#!/usr/bin/env python
"""The README's first command, before and after its recipe changed: wall time and validation loss, side by side.

Both sides run the README's own command (`python train_pretrain.py`) on the same data and validation split, one
after the other per seed, in fresh processes:

  before  the recipe the quick start used to have: fp32, full logits, lr 6e-4, 150 steps x 8 x 128 tokens,
          warmup 15 (the GELU is now the fused `gelu_pytorch_tanh`, the same function as `gelu_new`)
  after   today's defaults (no flags)

Prints wall time (process start to exit, setup included), steps, tokens, the final validation loss against the
unigram (7.88) and uniform (10.83) lines, and the ratios. `--candidate '--learning_rate 2e-3 ...'` adds rows for
other recipes (used to choose the defaults).

    python bench/quickstart.py                  # ~10 minutes per seed on 2 cores
    python bench/quickstart.py --seeds 1 --candidate '--max_steps 300 --learning_rate 2e-3'
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BEFORE = [
    "--mixed_precision",
    "no",
    "--loss_chunk_tokens",
    "0",
    "--learning_rate",
    "6e-4",
    "--max_steps",
    "150",
    "--warmup_steps",
    "15",
]
UNIGRAM, UNIFORM = 7.88, 10.83


def run(flags: list[str], seed: int) -> dict:
    from llmlab.core.io import read_jsonl

    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "train_pretrain.py", "--output_dir", out, "--seed", str(seed), *flags]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(f"{shlex.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        rows = read_jsonl(Path(out) / "metrics.jsonl")
        val = [r for r in rows if "val/loss" in r]
        train = [r for r in rows if "train/loss" in r]
        return {
            "wall_s": wall,
            "val_loss": val[-1]["val/loss"],
            "steps": train[-1]["step"],
            "tokens_per_sec": statistics.median(r["train/tokens_per_sec"] for r in train[5:]),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--candidate", action="append", default=[], help="extra recipe, as train_pretrain.py flags")
    args = parser.parse_args()
    sides = {"before": BEFORE, "after (defaults)": []}
    sides.update({f"candidate {i + 1}: {c}": shlex.split(c) for i, c in enumerate(args.candidate)})
    results: dict[str, list[dict]] = {name: [] for name in sides}
    for seed in range(42, 42 + args.seeds):
        for name, flags in sides.items():
            results[name].append(run(flags, seed))
            r = results[name][-1]
            print(f"  seed {seed} {name}: val loss {r['val_loss']:.3f}, {r['wall_s']:.0f} s", flush=True)
    base = results["before"]
    print("\n| recipe | steps | wall s (median) | tokens/s | val loss (per seed) | vs before: wall | vs before: loss |")
    print("|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        losses = [r["val_loss"] for r in runs]
        delta = statistics.mean(a["val_loss"] - b["val_loss"] for a, b in zip(runs, base))
        print(
            f"| {name} | {runs[0]['steps']} | {wall:.0f} | {statistics.median(r['tokens_per_sec'] for r in runs):.0f}"
            f" | {', '.join(f'{v:.3f}' for v in losses)} | {wall / statistics.median(r['wall_s'] for r in base):.2f}x"
            f" | {delta:+.3f} |"
        )
    print(f"\nreference lines: unigram {UNIGRAM}, uniform {UNIFORM} nats (builtin:wiki, block 128 validation split)")


if __name__ == "__main__":
    main()
