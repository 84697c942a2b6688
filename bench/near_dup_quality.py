"""Near-dup precision and recall on planted near-duplicates, through the real preparation pipeline.

Base documents (8-40 sentences of the builtin Wikipedia sample, as data_scale.py builds them) go in one set of
.jsonl files; each base's copy, with a random share (0-6 %) of its words replaced by words of other sentences, goes
in later files, so the copy is the one a correct near-dup drops. Every copy's true similarity is the exact Jaccard
of its shingle set with its base's (llmlab.data.minhash's definition). The corpus is prepared by prepare_dataset
with the defaults' near-dup (threshold 0.85, two workers, shards of 2M tokens so pairs cross shards), then the
kept documents are read back from the shards. Per Jaccard bin: copies, share removed (Wilson 95 % CI); overall:
recall at Jaccard >= 0.9 and >= the threshold, precision (removed copies whose Jaccard is >= the threshold, over all
removed documents), and how many bases were wrongly removed.

With `--copies MIN MAX`, each base gets a group of MIN to MAX copies (each edited on its own, so copies are less
alike to each other than to their base), shuffled among the later files; recall is then also given per group size,
and `--before COMMIT` runs the same corpus through an earlier commit's pipeline, side by side.

    python bench/near_dup_quality.py --bases 3000 --output docs/findings/data-scale/near_dup_quality.json
    python bench/near_dup_quality.py --bases 1000 --copies 2 10 --before e785ea2 \
        --output docs/findings/data-scale/near_dup_groups.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

BINS = [0.0, 0.6, 0.7, 0.75, 0.8, 0.825, 0.85, 0.875, 0.9, 0.95, 1.0001]


def planted_corpus(folder: Path, bases: int, seed: int, copies_per_base=(1, 1)) -> tuple[list[str], list, list[int]]:
    """Bases, then (base index, copy) pairs, and each copy's group size. One copy a base: the original bench's corpus,
    copies in base order; groups: copies shuffled among themselves, still after every base."""
    from data_scale import sentence_pool

    pool, rng = sentence_pool(), random.Random(seed)
    originals = [" ".join(rng.choice(pool) for _ in range(rng.randint(8, 40))) for _ in range(bases)]
    vocabulary = " ".join(rng.choice(pool) for _ in range(2000)).split()
    copies, group = [], []
    for index, text in enumerate(originals):
        size = rng.randint(*copies_per_base) if copies_per_base != (1, 1) else 1  # one copy: the original corpus
        for _ in range(size):
            words = text.split()
            share = rng.uniform(0.0, 0.06)
            for position in rng.sample(range(len(words)), max(1, round(share * len(words)))):
                words[position] = rng.choice(vocabulary)
            copies.append((index, " ".join(words)))
            group.append(size)
    if copies_per_base != (1, 1):
        order = list(range(len(copies)))
        rng.shuffle(order)
        copies, group = [copies[i] for i in order], [group[i] for i in order]
    folder.mkdir(parents=True, exist_ok=True)
    parts = [originals[: bases // 2], originals[bases // 2 :], [c for _, c in copies]]
    for part, texts in enumerate(parts):
        with open(folder / f"part-{part}.jsonl", "w") as handle:
            handle.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return originals, copies, group


PREPARE = (
    "import sys, json; from llmlab.data.prepare import DataConfig, prepare_dataset; "
    "p = prepare_dataset(DataConfig(dataset=sys.argv[1], cache_dir=sys.argv[2], block_size=32, val_fraction=0.0, "
    "near_dup_threshold=float(sys.argv[3]), num_proc=2, shard_tokens=2_000_000)); "
    "print('REPORT', json.dumps(p.report))"
)


def prepared_by(tree: Path, corpus: Path, cache: Path, threshold: float) -> tuple[dict, float]:
    """The corpus prepared by the llmlab of `tree` in its own process: its report and seconds."""
    import os
    import subprocess

    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", PREPARE, str(corpus), str(cache), str(threshold)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    report = json.loads(proc.stdout.split("REPORT ", 1)[1].splitlines()[0])
    return report, time.perf_counter() - start


def kept_texts(cache: Path, tokenizer) -> tuple[set[str], str]:
    """The documents in the train shards, and the start of the one the dropped tail remainder cut."""
    from llmlab.data.shards import MANIFEST, TokenBlocks

    folder = next(p.parent for p in cache.glob(f"*/{MANIFEST}"))
    train = TokenBlocks(folder, "train", 32)
    ids = train.window(0, len(train) * 32)
    documents = tokenizer.decode(ids.tolist()).split(tokenizer.eos_token)
    return set(documents[:-1]), documents[-1]


def wilson(k: int, n: int) -> tuple[float, float]:
    from statsmodels.stats.proportion import proportion_confint

    low, high = proportion_confint(k, n, alpha=0.05, method="wilson") if n else (float("nan"), float("nan"))
    return float(low), float(high)


def bins(similarity: np.ndarray, removed: np.ndarray) -> list[dict]:
    rows = []
    for low, high in zip(BINS[:-1], BINS[1:]):
        inside = (similarity >= low) & (similarity < high)
        n, k = int(inside.sum()), int(removed[inside].sum())
        rows.append(
            {
                "jaccard_from": low,
                "jaccard_to": min(high, 1.0),
                "copies": n,
                "removed": k,
                "share_removed": k / n if n else None,
                "ci95": wilson(k, n),
            }
        )
    return rows


def by_group_size(group: np.ndarray, true_dup: np.ndarray, removed: np.ndarray) -> list[dict]:
    """Recall among the copies at >= the threshold to their base, per group size (copies of one base)."""
    rows = []
    for size in sorted(set(group.tolist())):
        picked = (group == size) & true_dup
        n, k = int(picked.sum()), int(removed[picked].sum())
        rows.append({"group_size": size, "true_duplicates": n, "removed": k, "recall": k / n if n else None,
                     "ci95": wilson(k, n)})  # fmt: skip
    return rows


def measure(tree: Path, work: Path, originals, copies, group, similarity, threshold: float, tokenizer) -> dict:
    """One pipeline's result on the planted corpus: per Jaccard bin, per group size, the summary."""
    report, seconds = prepared_by(tree, work / "corpus", work / f"cache-{tree.name}", threshold)
    kept, cut = kept_texts(work / f"cache-{tree.name}", tokenizer)
    removed_copy = np.array([c not in kept and not c.startswith(cut) for _, c in copies])
    removed_base = sum(o not in kept and not o.startswith(cut) for o in originals)
    true_dup = similarity >= threshold
    removed_total = int(removed_copy.sum()) + removed_base
    summary = {
        "recall_at_0.9": float(removed_copy[similarity >= 0.9].mean()),
        "recall_at_threshold": float(removed_copy[true_dup].mean()),
        "precision": float(removed_copy[true_dup].sum() / max(removed_total, 1)),
        "bases_removed": int(removed_base),
        "removed_below_threshold": int(removed_copy[~true_dup].sum()),
        "surviving_true_duplicates": int((~removed_copy & true_dup).sum()),
        "report_near_duplicates": report["steps"][-1]["in"] - report["steps"][-1]["out"],
        "near_dup_disk_bytes_per_document": report["dedup"].get("near_dup_disk_bytes_per_document"),
        "near_dup_seconds": report["stage_seconds"].get("near_dup"),
        "seconds": round(seconds, 1),
    }
    groups = by_group_size(np.array(group), true_dup, removed_copy)
    return {"bins": bins(similarity, removed_copy), "by_group_size": groups, "summary": summary}


def print_result(label: str, result: dict) -> None:
    print(f"{label}: {json.dumps(result['summary'])}")
    print(f"{'Jaccard':<14}{'copies':>8}{'removed':>9}{'share':>8}   95% CI")
    for row in result["bins"]:
        share = "" if row["share_removed"] is None else f"{row['share_removed']:.3f}"
        ci = "" if row["share_removed"] is None else f"[{row['ci95'][0]:.3f}, {row['ci95'][1]:.3f}]"
        span = f"[{row['jaccard_from']:.2f}, {row['jaccard_to']:.2f})"
        print(f"{span}{row['copies']:>8}{row['removed']:>9}{share:>8}   {ci}")
    if len(result["by_group_size"]) > 1:
        print(f"{'group size':<12}{'true dups':>10}{'removed':>9}{'recall':>8}")
        for row in result["by_group_size"]:
            recall = "" if row["recall"] is None else f"{row['recall']:.3f}"
            print(f"{row['group_size']:<12}{row['true_duplicates']:>10}{row['removed']:>9}{recall:>8}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bases", type=int, default=3000, help="base documents (each gets its planted copies)")
    parser.add_argument("--copies", type=int, nargs=2, default=[1, 1], metavar=("MIN", "MAX"), help="copies a base")
    parser.add_argument("--seed", type=int, default=0, help="seed of the corpus and its edits")
    parser.add_argument("--threshold", type=float, default=0.85, help="--near_dup_threshold under test")
    parser.add_argument("--before", default=None, help="an earlier commit run on the same corpus, side by side")
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    from data_scale import previous_tree

    from llmlab.core.runinfo import machine_label
    from llmlab.data import minhash
    from llmlab.data.tokenizer import load_tokenizer

    work = Path(tempfile.mkdtemp(prefix="near-dup-quality-"))
    originals, copies, group = planted_corpus(work / "corpus", args.bases, args.seed, tuple(args.copies))
    base_shingles = [minhash.shingle_set(o) for o in originals]
    similarity = np.array([minhash.jaccard(base_shingles[b], minhash.shingle_set(c)) for b, c in copies])
    tokenizer = load_tokenizer()
    trees = {"now": REPO, **({"before": previous_tree(args.before, work)} if args.before else {})}
    print(f"{args.bases} bases + {len(copies)} planted copies, threshold {args.threshold}, {machine_label()}")
    results = {}
    for label, tree in trees.items():
        results[label] = measure(tree, work, originals, copies, group, similarity, args.threshold, tokenizer)
        print_result(label, results[label])
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "bases": args.bases,
            "copies_per_base": args.copies,
            "seed": args.seed,
            "threshold": args.threshold,
            "machine": machine_label(),
            **results["now"],
            **({"before": {"commit": args.before, **results["before"]}} if args.before else {}),
        }
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
