"""Peak memory against the size of one document: a corpus that is a single .txt.gz (as nanoGPT's input.txt is one
file), prepared end to end (read, clean, tokenise, stage, pack) by this tree and, side by side, by an earlier commit.

Each size is one document of Wikipedia sentences (data_scale.py's pool), 80-character-ish lines, gzip-compressed.
Each preparation runs in a fresh process, its whole process tree's PSS sampled every 0.2 s (data_scale.run_measured);
one more run times how long a single JSON line of 2 GB takes to be refused. Prints a table, and a JSON file with
--output:

    python bench/one_document.py --sizes_mb 64 256 1024 --before e785ea2 \
        --output docs/findings/data-scale/one_document.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

PREPARE = (
    "import sys; from llmlab.data.prepare import DataConfig, prepare_dataset; "
    "p = prepare_dataset(DataConfig(dataset=sys.argv[1], cache_dir=sys.argv[2], num_proc={workers})); "
    "print('TOKENS', p.report['tokens'])"
)


def one_document(path: Path, megabytes: int, pool: list[str], seed: int) -> None:
    """A .txt.gz of `megabytes` MB of text, one document; a finished file is reused."""
    if path.is_file():
        return
    rng, written = random.Random(seed), 0
    tmp = path.with_suffix(".partial")
    with gzip.open(tmp, "wt", compresslevel=1) as handle:
        while written < megabytes * 2**20:
            line = " ".join(rng.choice(pool) for _ in range(rng.randint(1, 3))) + "\n"
            handle.write(line)
            written += len(line)
    tmp.rename(path)


def giant_json_line(path: Path, gigabytes: float) -> None:
    if path.is_file():
        return
    tmp = path.with_suffix(".partial")
    with gzip.open(tmp, "wb", compresslevel=1) as handle:
        handle.write(b'{"text": "')
        chunk = b"word " * (1 << 18)
        for _ in range(int(gigabytes * 2**30) // len(chunk)):
            handle.write(chunk)
        handle.write(b'"}\n')
    tmp.rename(path)


def refusal(tree: Path, path: Path, work: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", PREPARE.format(workers=1), str(path), str(work / "refused")],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    return {"seconds": round(time.perf_counter() - start, 1), "exit": proc.returncode, "message": last[:300]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes_mb", type=int, nargs="+", default=[64, 256, 1024], help="document sizes (MB of text)")
    parser.add_argument("--before", default=None, help="an earlier commit, run side by side at the sizes it can take")
    parser.add_argument("--before_max_mb", type=int, default=256, help="largest size the earlier commit runs")
    parser.add_argument("--json_line_gb", type=float, default=2.0, help="size of the single JSON line to refuse")
    parser.add_argument("--workers", type=int, default=2, help="--num_proc of each preparation")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp folder)")
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    from data_scale import previous_tree, run_measured, sentence_pool

    from llmlab.core.runinfo import machine_label

    work = args.work or Path(tempfile.mkdtemp(prefix="one-document-"))
    pool = sentence_pool()
    trees = {"now": REPO, **({"before": previous_tree(args.before, work)} if args.before else {})}
    rows = []
    for megabytes in args.sizes_mb:
        path = work / f"one-{megabytes}mb.txt.gz"
        one_document(path, megabytes, pool, seed=megabytes)
        for label, tree in trees.items():
            if label == "before" and megabytes > args.before_max_mb:
                continue
            cache = work / f"cache-{label}-{megabytes}"
            env = {**os.environ, "PYTHONPATH": str(tree)}
            command = [sys.executable, "-c", PREPARE.format(workers=args.workers), str(path), str(cache)]
            measured = run_measured(command, tree, env)
            rows.append({"tree": label, "document_mb": megabytes, **measured})
            print(
                f"{label:<7}{megabytes:>6} MB  {measured['seconds']:>7.1f} s  {measured['tokens']:>12,} tokens  "
                f"peak {measured['peak_rss_mb']:>7.0f} MB",
                flush=True,
            )
            subprocess.run(["rm", "-rf", str(cache)], check=False)
    line = work / "one-line.jsonl.gz"
    giant_json_line(line, args.json_line_gb)
    refused = {label: refusal(tree, line, work) for label, tree in trees.items() if label == "now"}
    print(f"a {args.json_line_gb:g} GB JSON line: {refused['now']}", flush=True)
    if args.output:
        result = {
            "machine": machine_label(),
            "before": args.before,
            "workers": args.workers,
            "rows": rows,
            "json_line_gb": args.json_line_gb,
            "json_line": refused["now"],
        }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
