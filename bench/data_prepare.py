"""Throughput of the whole data preparation (load, clean, dedup, tokenise, pack, save): num_proc=1 vs 2.

"CPU s" is the CPU time all processes spent, so worker overhead shows even on a busy machine.
Every run writes into a fresh temp cache dir, so nothing is reused; a small warm-up run first pays
the one-off imports. The runs alternate between the settings and the median is reported. The two
settings must produce identical blocks; the script checks that too.

    python bench/data_prepare.py                      # default corpus (builtin:wiki), 2 repeats
    python bench/data_prepare.py --repeats 3 --num_proc 1 2 4 --dataset my_corpus/
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmlab.data.prepare import DataConfig, prepare_dataset  # noqa: E402
from llmlab.data.tokenizer import load_tokenizer  # noqa: E402


def blocks_digest(prepared) -> str:
    h = hashlib.sha256()
    for split in (prepared.train, prepared.validation):
        h.update(split["input_ids"].tobytes())
    return h.hexdigest()[:16]


def cpu_seconds() -> float:
    """User+system CPU of this process and its finished children (the map workers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    # long: the bench is its steps in order (options, corpus, the prepare runs, the table); split, it reads worse
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="builtin:wiki")
    parser.add_argument("--block_size", type=int, default=1024)
    parser.add_argument(
        "--num_proc", type=int, nargs="+", default=[1, 2], help="settings to compare; first is the baseline"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max_documents", type=int, default=None)
    args = parser.parse_args()

    import datasets

    datasets.disable_progress_bars()
    tokenizer = load_tokenizer()
    load_before = os.getloadavg()[0]  # other work on the machine skews the comparison; print it
    with tempfile.TemporaryDirectory() as tmp:
        prepare_dataset(
            DataConfig(dataset=args.dataset, cache_dir=f"{tmp}/warmup", max_documents=2, block_size=64), tokenizer
        )
        runs: dict[int, list[dict]] = {n: [] for n in args.num_proc}
        digests: dict[int, str] = {}
        for repeat in range(args.repeats):
            for n in args.num_proc:
                cfg = DataConfig(
                    dataset=args.dataset,
                    block_size=args.block_size,
                    num_proc=n,
                    max_documents=args.max_documents,
                    cache_dir=f"{tmp}/r{repeat}-p{n}",
                )
                cpu_before = cpu_seconds()
                prepared = prepare_dataset(cfg, tokenizer)
                prepared.report["cpu_seconds"] = cpu_seconds() - cpu_before
                assert not prepared.report["cache_hit"]
                runs[n].append(prepared.report)
                digests[n] = blocks_digest(prepared)
                print(
                    f"  repeat {repeat + 1}/{args.repeats} num_proc={n}: {prepared.report['prepare_seconds']:.2f} s",
                    file=sys.stderr,
                )

    first = runs[args.num_proc[0]][0]
    print(
        f"dataset {args.dataset}: {first['steps'][0]['out']} documents loaded, {first['documents']} kept, "
        f"{first['tokens']:,} tokens, block_size {args.block_size}; {os.cpu_count()} CPUs; "
        f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', 'unset')}; median of {args.repeats}; "
        f"load average before/after {load_before:.1f}/{os.getloadavg()[0]:.1f}"
    )
    header = (
        f"{'num_proc':>8} {'seconds':>9} {'CPU s':>7} {'docs/s':>9} {'tokens/s':>11} {'tokenize tok/s':>15} "
        f"{'speed-up':>9}"
    )
    print(header)
    print("-" * len(header))
    base_seconds = None
    for n in args.num_proc:
        seconds = statistics.median(r["prepare_seconds"] for r in runs[n])
        tok_seconds = statistics.median(r["tokenize_seconds"] for r in runs[n])
        base_seconds = base_seconds or seconds
        cpu = statistics.median(r["cpu_seconds"] for r in runs[n])
        print(
            f"{n:>8} {seconds:>9.2f} {cpu:>7.1f} {first['steps'][0]['out'] / seconds:>9.1f} "
            f"{first['tokens'] / seconds:>11,.0f} "
            f"{first['tokens'] / tok_seconds:>15,.0f} {base_seconds / seconds:>8.2f}x"
        )
    stages = list(first["stage_seconds"])
    print("\nmedian seconds per stage")
    print(f"{'num_proc':>8} " + " ".join(f"{s:>9}" for s in stages))
    for n in args.num_proc:
        print(
            f"{n:>8} " + " ".join(f"{statistics.median(r['stage_seconds'][s] for r in runs[n]):>9.2f}" for s in stages)
        )
    identical = len(set(digests.values())) == 1
    print(f"identical blocks across num_proc settings: {identical}")
    if not identical:
        sys.exit(f"error: num_proc changed the prepared blocks: {digests}")


if __name__ == "__main__":
    main()
