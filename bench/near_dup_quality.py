"""Near-dup precision and recall on planted near-duplicates, through the real preparation pipeline.

Base documents (8-40 sentences of the builtin Wikipedia sample, as data_scale.py builds them) go in one set of
.jsonl files; each base's copy, with a random share (0-6 %) of its words replaced by words of other sentences, goes
in later files, so the copy is the one a correct near-dup drops. Every copy's true similarity is the exact Jaccard
of its shingle set with its base's (llmlab.data.minhash's definition). The corpus is prepared by prepare_dataset
with the defaults' near-dup (threshold 0.85, two workers, shards of 2M tokens so pairs cross shards), then the
kept documents are read back from the shards. Per Jaccard bin: copies, share removed (Wilson 95 % CI); overall:
recall at Jaccard >= 0.9 and >= the threshold, precision (removed copies whose Jaccard is >= the threshold, over all
removed documents), and how many bases were wrongly removed.

    python bench/near_dup_quality.py --bases 3000 --output docs/findings/data-scale/near_dup_quality.json
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


def planted_corpus(folder: Path, bases: int, seed: int) -> tuple[list[str], list[str]]:
    from data_scale import sentence_pool

    pool, rng = sentence_pool(), random.Random(seed)
    originals = [" ".join(rng.choice(pool) for _ in range(rng.randint(8, 40))) for _ in range(bases)]
    vocabulary = " ".join(rng.choice(pool) for _ in range(2000)).split()
    copies = []
    for text in originals:
        words = text.split()
        share = rng.uniform(0.0, 0.06)
        for position in rng.sample(range(len(words)), max(1, round(share * len(words)))):
            words[position] = rng.choice(vocabulary)
        copies.append(" ".join(words))
    folder.mkdir(parents=True, exist_ok=True)
    for part, texts in enumerate([originals[: bases // 2], originals[bases // 2 :], copies]):
        with open(folder / f"part-{part}.jsonl", "w") as handle:
            handle.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return originals, copies


def kept_texts(prepared, tokenizer) -> tuple[set[str], str]:
    """The documents in the train shards, and the start of the one the dropped tail remainder cut."""
    ids = prepared.train.window(0, len(prepared.train) * prepared.report["block_size"])
    documents = tokenizer.decode(ids.tolist()).split(tokenizer.eos_token)
    return set(documents[:-1]), documents[-1]


def wilson(k: int, n: int) -> tuple[float, float]:
    from statsmodels.stats.proportion import proportion_confint

    low, high = proportion_confint(k, n, alpha=0.05, method="wilson") if n else (float("nan"), float("nan"))
    return float(low), float(high)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bases", type=int, default=3000, help="base documents (each gets one planted copy)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the corpus and its edits")
    parser.add_argument("--threshold", type=float, default=0.85, help="--near_dup_threshold under test")
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    from llmlab.core.runinfo import machine_label
    from llmlab.data import minhash
    from llmlab.data.prepare import DataConfig, prepare_dataset
    from llmlab.data.tokenizer import load_tokenizer

    work = Path(tempfile.mkdtemp(prefix="near-dup-quality-"))
    originals, copies = planted_corpus(work / "corpus", args.bases, args.seed)
    similarity = np.array(
        [minhash.jaccard(minhash.shingle_set(a), minhash.shingle_set(b)) for a, b in zip(originals, copies)]
    )
    cfg = DataConfig(
        dataset=str(work / "corpus"),
        cache_dir=str(work / "cache"),
        block_size=32,
        val_fraction=0.0,
        near_dup_threshold=args.threshold,
        num_proc=2,
        shard_tokens=2_000_000,
    )
    tokenizer = load_tokenizer()
    start = time.perf_counter()
    prepared = prepare_dataset(cfg, tokenizer)
    seconds = time.perf_counter() - start
    kept, cut = kept_texts(prepared, tokenizer)
    removed_copy = np.array([c not in kept and not c.startswith(cut) for c in copies])
    removed_base = sum(o not in kept and not o.startswith(cut) for o in originals)
    rows = []
    for low, high in zip(BINS[:-1], BINS[1:]):
        inside = (similarity >= low) & (similarity < high)
        n, k = int(inside.sum()), int(removed_copy[inside].sum())
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
    true_dup = similarity >= args.threshold
    removed_total = int(removed_copy.sum()) + removed_base
    summary = {
        "recall_at_0.9": float(removed_copy[similarity >= 0.9].mean()),
        "recall_at_threshold": float(removed_copy[true_dup].mean()),
        "precision": float(removed_copy[true_dup].sum() / max(removed_total, 1)),
        "bases_removed": int(removed_base),
        "removed_below_threshold": int(removed_copy[~true_dup].sum()),
        "report_near_duplicates": prepared.report["steps"][-1]["in"] - prepared.report["steps"][-1]["out"],
        "near_dup_disk_bytes_per_document": prepared.report["dedup"].get("near_dup_disk_bytes_per_document"),
        "seconds": round(seconds, 1),
    }
    print(f"{args.bases} bases + {args.bases} planted copies, threshold {args.threshold}, {machine_label()}")
    print(f"{'Jaccard':<14}{'copies':>8}{'removed':>9}{'share':>8}   95% CI")
    for row in rows:
        share = "" if row["share_removed"] is None else f"{row['share_removed']:.3f}"
        ci = "" if row["share_removed"] is None else f"[{row['ci95'][0]:.3f}, {row['ci95'][1]:.3f}]"
        print(
            f"[{row['jaccard_from']:.2f}, {row['jaccard_to']:.2f})"
            f"{row['copies']:>8}{row['removed']:>9}{share:>8}   {ci}"
        )
    print(json.dumps(summary, indent=1))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "bases": args.bases,
            "seed": args.seed,
            "threshold": args.threshold,
            "machine": machine_label(),
            "bins": rows,
            "summary": summary,
        }
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
