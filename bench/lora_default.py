#!/usr/bin/env python
"""Which LoRA recipe shows its effect on a CPU within ten minutes? Candidates measured end to end.

Each candidate is one `python train_lora.py` run (the README's command, with the candidate's flags) on the quick-start
base (`python train_pretrain.py`'s runs/pretrain/final), timed wall to wall including both evaluations. The table
gives every candidate's test-split perplexity and ROUGE-L before -> after with the paired bootstrap 95 % CIs that
train_lora.py writes to eval.json. Runs one after another on all cores; results land in --out/results.json.

    python bench/lora_default.py --base runs/pretrain/final       # about 40 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from findings import lora_default_table  # noqa: E402

# The adapters compared: the old default (r 8 on GPT-2's attention input projection) and every linear layer.
C_ATTN_R8 = ["--lora_r", "8", "--lora_alpha", "16", "--target_modules", "c_attn"]
ALL_BLOCKS_R16 = ["--lora_r", "16", "--lora_alpha", "32", "--target_modules", "c_attn", "c_proj", "c_fc"]


def recipe(lr: str, steps: str, warmup: str, adapter: list[str]) -> list[str]:
    return ["--learning_rate", lr, "--max_steps", steps, "--max_length", "128", "--warmup_steps", warmup, *adapter]


CANDIDATES = {
    "r 8 c_attn, lr 3e-4 (the old lr), 150 steps, length 128": recipe("3e-4", "150", "15", C_ATTN_R8),
    "r 8 c_attn, lr 1e-3, 150 steps, length 128": recipe("1e-3", "150", "15", C_ATTN_R8),
    "r 16 all blocks, lr 1e-3, 150 steps, length 128": recipe("1e-3", "150", "15", ALL_BLOCKS_R16),
    "r 16 all blocks, lr 3e-3, 150 steps, length 128": recipe("3e-3", "150", "15", ALL_BLOCKS_R16),
    "r 16 all blocks, lr 1e-3, 500 steps, length 128": recipe("1e-3", "500", "25", ALL_BLOCKS_R16),
    "r 16 all blocks, lr 3e-3, 500 steps, length 128": recipe("3e-3", "500", "25", ALL_BLOCKS_R16),
}
COMMON = [
    "--eval_every",
    "25",
    "--patience",
    "4",
    "--eval_examples",
    "32",
    "--max_new_tokens",
    "32",
    "--batch_size",
    "8",
    "--gradient_accumulation_steps",
    "2",
    "--sample_every",
    "1000",
    "--save_every",
    "0",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="runs/pretrain/final", help="the pretrained base model folder")
    parser.add_argument("--out", default="runs/lora_default", help="one run folder per candidate, and results.json")
    parser.add_argument("--only", nargs="*", help="run only the candidates whose name contains one of these")
    args = parser.parse_args()
    out = Path(args.out)
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    for index, (name, flags) in enumerate(CANDIDATES.items()):
        if name in results or (args.only and not any(o in name for o in args.only)):
            continue
        folder = out / f"candidate{index}"
        started = time.time()
        cmd = [
            sys.executable,
            "train_lora.py",
            "--base_model",
            args.base,
            "--output_dir",
            str(folder),
            "--overwrite_output_dir",
            *COMMON,
            *flags,
        ]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        report = json.loads((folder / "eval.json").read_text())
        results[name] = {"flags": flags, "seconds": round(time.time() - started, 1), "report": report}
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
        print(f"{name}: {results[name]['seconds']:.0f} s", flush=True)
    print(lora_default_table(results))  # the same table docs/findings shows


if __name__ == "__main__":
    main()
