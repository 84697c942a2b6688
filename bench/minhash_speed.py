"""Near-duplicate signatures side by side with the tokenizer, on one core: which MinHash keeps up with tiktoken?

The same documents (data_scale.py's: 8-40 sentences of the builtin Wikipedia sample) go through
- tiktoken: GPT-2's BPE, encode_ordinary_batch on one thread (the pipeline's tokenisation, the baseline);
- datasketch: MinHash.bulk over word 5-gram shingles hashed with crc32 (llmlab's near-dup before this bench);
- rensa: RMinHash (Rust) over the same word 5-gram shingles;
- datatrove: its MinhashDedupSignature's shingling (xxhash of word 5-grams; words split on whitespace, as its
  spacy tokenizer is not installed) and numpy signature;
- llmlab: llmlab/data/minhash.py: word 5-grams found and hashed in numpy over the whole batch's bytes, then
  one-permutation MinHash.
The three others are measured, not dependencies: `pip install datasketch==2.0.0 rensa==0.5.0` and
`pip install --no-deps datatrove==0.10.1 loguru humanize`; one not installed is listed as such. Each candidate runs
--repeats times in turn; the table gives the median seconds and tokens/s, and its cost per token as a ratio to
tiktoken's.

    python bench/minhash_speed.py --documents 2000 --output docs/findings/data-scale/minhash_speed.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def documents(count: int, seed: int) -> list[str]:
    from data_scale import sentence_pool

    pool, rng = sentence_pool(), random.Random(seed)
    return [" ".join(rng.choice(pool) for _ in range(rng.randint(8, 40))) for _ in range(count)]


def candidates(texts: list[str]):
    from llmlab.data import minhash
    from llmlab.data.tokenizer import fast_gpt2_encoder

    encoder = fast_gpt2_encoder()
    yield "tiktoken", lambda: encoder.encode_ordinary_batch(texts, num_threads=1)
    yield "llmlab", lambda: [minhash.signatures(texts[i : i + 256]) for i in range(0, len(texts), 256)]
    try:
        from datasketch import MinHash
    except ImportError:
        yield "datasketch", None
    else:
        yield (
            "datasketch",
            lambda: MinHash.bulk(
                [list(word_shingles(t)) for t in texts], num_perm=128, seed=1, scheme="affine32", hashfunc=zlib.crc32
            ),
        )
    try:
        from rensa import RMinHash
    except ImportError:
        yield "rensa", None
    else:

        def rensa_signatures():
            for text in texts:
                m = RMinHash(num_perm=128, seed=1)
                m.update([s.decode() for s in word_shingles(text)])
                m.digest()

        yield "rensa", rensa_signatures
    try:
        from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
    except ImportError:
        yield "datatrove", None
    else:
        from datatrove.utils import word_tokenizers

        class Whitespace:  # its English default needs spacy; splitting on whitespace is cheaper, so this flatters it
            def word_tokenize(self, text, **_):
                return text.split()

        word_tokenizers.load_word_tokenizer = lambda language: Whitespace()
        import datatrove.pipeline.dedup.minhash as datatrove_minhash

        datatrove_minhash.load_word_tokenizer = word_tokenizers.load_word_tokenizer
        stage = MinhashDedupSignature(output_folder=tempfile.mkdtemp(), config=MinhashConfig())
        import xxhash

        stage._hash_func = lambda text: xxhash.xxh64_intdigest(text.encode())  # the installed xxhash takes bytes
        yield "datatrove", lambda: [stage.get_signature(stage.get_shingles(t)) for t in texts]


def word_shingles(text: str) -> set[bytes]:
    """Word 5-grams of the lower-cased text, as strings: what datasketch and rensa hash (llmlab's before this)."""
    words = re.findall(r"\w+", text.lower())
    if len(words) <= 5:
        return {" ".join(words).encode()}
    return {" ".join(words[i : i + 5]).encode() for i in range(len(words) - 4)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=2000, help="documents in the sample")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each candidate (median reported)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document sample")
    parser.add_argument("--output", type=Path, help="write the table as JSON here")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from llmlab.core.runinfo import machine_label

    texts = documents(args.documents, args.seed)
    from llmlab.data.tokenizer import fast_gpt2_encoder

    tokens = sum(len(t) for t in fast_gpt2_encoder().encode_ordinary_batch(texts, num_threads=1))
    runs = list(candidates(texts))
    times: dict[str, list[float]] = {name: [] for name, fn in runs if fn is not None}
    for _ in range(args.repeats):  # interleaved, so a noisy neighbour hits every candidate alike
        for name, fn in runs:
            if fn is not None:
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["tiktoken"])
    rows = []
    for name, fn in runs:
        if fn is None:
            rows.append({"candidate": name, "installed": False})
            continue
        median = statistics.median(times[name])
        rows.append(
            {
                "candidate": name,
                "installed": True,
                "median_s": round(median, 4),
                "tokens_per_s": round(tokens / median),
                "cost_vs_tiktoken": round(median / base, 3),
            }
        )
    print(f"{args.documents} documents, {tokens:,} tokens, one core, median of {args.repeats}")
    print(f"{'candidate':<16}{'median s':>10}{'tokens/s':>14}{'x tiktoken':>12}")
    for row in rows:
        if row["installed"]:
            print(
                f"{row['candidate']:<16}{row['median_s']:>10.3f}{row['tokens_per_s']:>14,}{row['cost_vs_tiktoken']:>12.2f}"
            )
        else:
            print(f"{row['candidate']:<16}{'not installed':>36}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "documents": args.documents,
            "tokens": tokens,
            "repeats": args.repeats,
            "rows": rows,
            "cpu": machine_label(),
        }
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
