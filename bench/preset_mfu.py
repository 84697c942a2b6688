#!/usr/bin/env python
"""Tokens/s and model FLOPs utilisation of every GPT-2 preset, through the README's command, on this machine.

Each preset trains for a few steps in a fresh `python train_pretrain.py` process at its precision (default: the
trainer's `auto`); the table gives the median tokens/s and train/mfu of the steps after `--skip`, where MFU is
6N + attention FLOPs per token against this machine's matmul peak in that precision (measured on CPU, the
datasheet on a known GPU). Each row is its own ratio: achieved FLOP/s / peak FLOP/s.

    python bench/preset_mfu.py                               # ~5 minutes on 2 CPU cores
    python bench/preset_mfu.py --precision no bf16 --presets gpt2-tiny
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# preset: (micro batch, block size, steps); small enough for a CPU, long enough to leave warm-up behind
SHAPES = {"gpt2-tiny": (8, 128, 20), "gpt2": (2, 512, 5), "gpt2-medium": (1, 512, 4)}


def measure(preset: str, precision: str, skip: int) -> dict:
    from llmlab.core.io import read_jsonl

    batch, block, steps = SHAPES[preset]
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "train_pretrain.py",
            "--model",
            preset,
            "--batch_size",
            str(batch),
            "--effective_batch_size",
            str(batch),
            "--block_size",
            str(block),
            "--max_steps",
            str(steps),
            "--warmup_steps",
            "1",
            "--mixed_precision",
            precision,
            "--eval_every",
            "0",
            "--val_fraction",
            "0",
            "--save_every",
            "1000000",
            "--sample_tokens",
            "0",
            "--output_dir",
            out,
        ]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        rows = [r for r in read_jsonl(Path(out) / "metrics.jsonl") if "train/loss" in r][skip:]
    return {
        "tokens_per_sec": statistics.median(r["train/tokens_per_sec"] for r in rows),
        "mfu": statistics.median(r["train/mfu"] for r in rows) if all("train/mfu" in r for r in rows) else None,
        "shape": f"{batch} x {block}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--precision", nargs="+", default=["auto"], choices=["auto", "no", "bf16", "fp16"])
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the medians")
    args = parser.parse_args()
    print("| preset | batch x block | precision | tokens/s | MFU |")
    print("|---|---|---|---|---|")
    for preset in args.presets:
        for precision in args.precision:
            r = measure(preset, precision, args.skip)
            mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f} %"
            print(f"| {preset} | {r['shape']} | {precision} | {r['tokens_per_sec']:.0f} | {mfu} |", flush=True)


if __name__ == "__main__":
    main()
