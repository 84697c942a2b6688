"""The data pipeline on small real corpora: cleaning, packing, split, cache, bad input."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmlab.core.errors import UserError
from llmlab.data import prepare as data_mod
from llmlab.data.cleaning import clean_text
from llmlab.data.packing import split_documents
from llmlab.data.prepare import DataConfig, format_prepare_summary, prepare_dataset
from llmlab.data.shards import MANIFEST

WORDS = (
    "river stone garden window market letter engine harbor winter silver forest lantern village "
    "thunder meadow copper bridge candle orchard valley mirror falcon ribbon castle pepper canyon "
    "marble anchor violet saddle walnut compass glacier tunnel feather basket plaster comet willow "
    "ladder shadow quartz timber oyster sparrow granite pillow harvest beacon"
).split()


def random_doc(rng: random.Random, n_words: int = 120) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + "."


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def cfg_for(tmp_path: Path, dataset, **kw) -> DataConfig:
    defaults = dict(dataset=str(dataset), cache_dir=str(tmp_path / "cache"), block_size=32, val_fraction=0.0)
    return DataConfig(**{**defaults, **kw})


def decoded_documents(prepared, tokenizer) -> list[str]:
    """All blocks of both splits, joined and cut at eos back into document texts."""
    ids = [i for split in (prepared.train, prepared.validation) for row in split["input_ids"] for i in row]
    text = tokenizer.decode(ids)
    return [d for d in text.split(tokenizer.eos_token)]


@pytest.fixture()
def planted(tmp_path):
    """A JSONL corpus with known HTML, short, exact-duplicate and near-duplicate documents."""
    rng = random.Random(0)
    distinct = [random_doc(rng) for _ in range(6)]
    words = distinct[0].split()
    words[60] = "zeppelin"  # one word changed out of 120: 5-gram Jaccard ~0.92
    near_dup = " ".join(words).upper().replace(".", "!")
    half_shared = " ".join(distinct[1].split()[:60] + random_doc(rng).split()[60:])  # Jaccard ~0.33: kept
    html_doc = (
        "<html><body><p>Ｆｕｌｌ　ｗｉｄｔｈ &amp; <b>bold</b></p><script>var x = 1;</script> "
        + random_doc(rng)
        + "</body></html>"
    )
    texts = [
        *distinct,
        "too short",  # under 50 characters
        distinct[2],  # exact duplicate
        "<div>" + distinct[3] + "</div>",  # exact duplicate once the markup is stripped
        near_dup,
        half_shared,
        html_doc,
    ]
    return write_jsonl(tmp_path / "corpus.jsonl", texts), distinct, half_shared


def test_clean_text_strips_markup_and_normalises():
    raw = (
        "<p class='x'>Ｈｅｌｌｏ　ＷＯＲＬＤ １２３</p><!-- hidden --><style>p {}</style>"
        "<script>alert(1)</script>&lt;kept&gt; &amp; '''bold''' ''it'' [[Target page|link text]] {{cite web}}\n"
        "== Heading ==\n\n\n\ntext\nFile:Snow.jpg|Range in snow\nA grave|alt=Two stones"
    )
    assert clean_text(
        raw
    ) == "Hello WORLD 123 <kept> & bold it link text \nHeading\n\ntext\nRange in snow\nA grave".replace(" \n", "\n")


def test_cleaning_removes_planted_documents_and_keeps_distinct(tmp_path, planted, gpt2_tokenizer):
    path, distinct, half_shared = planted
    prepared = prepare_dataset(cfg_for(tmp_path, path, block_size=16), gpt2_tokenizer)
    removed = {s["step"].split(" (")[0]: s["in"] - s["out"] for s in prepared.report["steps"]}
    assert removed == {"loaded": 0, "shorter than 50 chars": 1, "exact duplicates": 2, "near duplicates": 1}
    assert prepared.report["documents"] == 8
    text = "".join(decoded_documents(prepared, gpt2_tokenizer))
    for doc in distinct:  # first occurrences survive (tail remainder aside, checked via substrings)
        assert doc[:80] in text
    assert half_shared[-80:] in text
    assert "ZEPPELIN" not in text and "too short" not in text
    assert "<" not in text and "&amp;" not in text and "alert" not in text and "var x" not in text
    assert "Full width & bold" in text  # NFKC turned full-width letters and the ideographic space into ASCII
    assert "removed" in format_prepare_summary(prepared.report)


def test_near_dup_threshold_zero_disables(tmp_path, planted, gpt2_tokenizer):
    path, _, _ = planted
    prepared = prepare_dataset(cfg_for(tmp_path, path, near_dup_threshold=0.0), gpt2_tokenizer)
    assert prepared.report["steps"][-1]["in"] == prepared.report["steps"][-1]["out"]
    assert prepared.report["documents"] == 9


def test_packing_conserves_tokens_and_eos(tmp_path, gpt2_tokenizer):
    rng = random.Random(1)
    texts = [random_doc(rng, rng.randint(15, 90)) for _ in range(12)]
    cfg = cfg_for(tmp_path, write_jsonl(tmp_path / "c.jsonl", texts), block_size=37, near_dup_threshold=0.0)
    prepared = prepare_dataset(cfg, gpt2_tokenizer)
    eos = gpt2_tokenizer.eos_token_id
    doc_ids = [gpt2_tokenizer(t)["input_ids"] + [eos] for t in texts]
    order = split_documents(np.array([len(d) for d in doc_ids]), 0.0, cfg.data_seed)[0]
    stream = [i for d in order for i in doc_ids[d]]
    blocks = prepared.train["input_ids"]
    assert all(len(b) == 37 for b in blocks)
    flat = [i for b in blocks for i in b]
    assert flat == stream[: len(flat)]  # every token, in document order, eos after each document
    assert len(stream) - len(flat) < 37 == cfg.block_size  # only a partial tail block is dropped
    assert prepared.report["dropped_tail_tokens"] == len(stream) - len(flat)
    assert flat.count(eos) == stream[: len(flat)].count(eos) >= len(texts) - 1


def test_split_is_deterministic_disjoint_and_sized(tmp_path, gpt2_tokenizer):
    rng = random.Random(2)
    texts = [random_doc(rng, 60) for _ in range(40)]
    path = write_jsonl(tmp_path / "c.jsonl", texts)
    base = dict(block_size=16, val_fraction=0.2, near_dup_threshold=0.0)
    a = prepare_dataset(cfg_for(tmp_path, path, **base, cache_dir=str(tmp_path / "a")), gpt2_tokenizer)
    b = prepare_dataset(cfg_for(tmp_path, path, **base, cache_dir=str(tmp_path / "b")), gpt2_tokenizer)
    assert a.report["cache_hit"] is False and b.report["cache_hit"] is False
    assert np.array_equal(a.train["input_ids"], b.train["input_ids"])
    assert np.array_equal(a.validation["input_ids"], b.validation["input_ids"])
    c = prepare_dataset(cfg_for(tmp_path, path, **base, data_seed=99), gpt2_tokenizer)
    assert not np.array_equal(c.validation["input_ids"], a.validation["input_ids"])
    total = a.report["train_tokens"] + a.report["validation_tokens"] + a.report["dropped_tail_tokens"]
    assert total == a.report["tokens"]
    assert 0.15 < a.report["validation_tokens"] / a.report["tokens"] < 0.3
    train_docs, val_docs = split_documents(np.array([5] * 40), 0.2, 7)
    assert set(train_docs).isdisjoint(val_docs) and len(train_docs) + len(val_docs) == 40 and len(val_docs) == 8


def test_cache_reuse_and_invalidation(tmp_path, gpt2_tokenizer, monkeypatch):
    rng = random.Random(3)
    path = write_jsonl(tmp_path / "c.jsonl", [random_doc(rng) for _ in range(5)])
    cfg = cfg_for(tmp_path, path)
    first = prepare_dataset(cfg, gpt2_tokenizer)
    assert first.report["cache_hit"] is False and (first.cache_path / MANIFEST).is_file()

    def forbidden(*a, **k):
        raise AssertionError("a cache hit must not load or tokenise the corpus again")

    with monkeypatch.context() as m:
        m.setattr(data_mod, "_process_batch", forbidden)
        m.setattr(data_mod.corpus, "iter_documents", forbidden)
        again = prepare_dataset(cfg, gpt2_tokenizer)
    assert again.report["cache_hit"] is True and again.cache_path == first.cache_path
    assert np.array_equal(again.train["input_ids"], first.train["input_ids"])
    assert again.train.records and again.train.dtype == np.uint16  # GPT-2 ids in 2 bytes, memory-mapped

    paths = {first.cache_path}
    for change in (
        dict(block_size=16),
        dict(min_doc_chars=10),
        dict(near_dup_threshold=0.5),
        dict(val_fraction=0.2),
        dict(data_seed=5),
    ):
        other = prepare_dataset(cfg_for(tmp_path, path, **change), gpt2_tokenizer)
        assert other.report["cache_hit"] is False, change
        paths.add(other.cache_path)
    assert len(paths) == 6
    write_jsonl(path, [random_doc(rng) for _ in range(6)])  # new content (and size / mtime)
    changed = prepare_dataset(cfg, gpt2_tokenizer)
    assert changed.report["cache_hit"] is False and changed.cache_path not in paths


def test_a_truncated_or_corrupt_shard_is_named_and_refused(tmp_path, gpt2_tokenizer):
    rng = random.Random(4)
    cfg = cfg_for(tmp_path, write_jsonl(tmp_path / "c.jsonl", [random_doc(rng) for _ in range(6)]), shard_tokens=64)
    first = prepare_dataset(cfg, gpt2_tokenizer)
    shard = first.cache_path / first.train.records[1]["file"]
    original = shard.read_bytes()
    shard.write_bytes(original[:-2])
    with pytest.raises(UserError, match=rf"{shard.name} is {len(original) - 2} bytes.*truncated"):
        prepare_dataset(cfg, gpt2_tokenizer)
    shard.write_bytes(original[:10] + bytes([original[10] ^ 1]) + original[11:])  # one bit, same size
    with pytest.raises(UserError, match=rf"{shard.name} does not match its sha256"):
        prepare_dataset(cfg, gpt2_tokenizer)
    shard.write_bytes(original)
    assert prepare_dataset(cfg, gpt2_tokenizer).report["cache_hit"] is True


KILL_SCRIPT = """
import os, signal, sys
from llmlab.data import prepare as data
target, seen = sys.argv[3], {"stage": 0, "buckets": 0, "clusters": 0, "pack": 0}
real = {"stage": data._checkpoint, "pack": data.atomic_write_json, "save": data._save_npy}
def dying(hook):
    def call(*args, **kwargs):
        real[hook](*args, **kwargs)
        path, name = str(args[0]), hook
        if hook == "pack" and not path.endswith("pack.json"):
            return
        if hook == "save":  # the near-dup stages' files: a band's pairs, then the clusters' result
            name = "buckets" if "pairs_" in path else "clusters" if path.endswith("removed.npy") else None
            if name is None:
                return
        seen[name] += 1
        if name == target and seen[name] == (1 if name == "clusters" else 2):
            os.kill(os.getpid(), signal.SIGKILL)  # killed after its second checkpoint (the clusters' only one)
    return call
data._checkpoint, data.atomic_write_json, data._save_npy = dying("stage"), dying("pack"), dying("save")
data.prepare_dataset(data.DataConfig(dataset=sys.argv[1], cache_dir=sys.argv[2], block_size=32, val_fraction=0.2,
                                     shard_tokens=256, num_proc=2))
"""


def with_near_copies(rng: random.Random, docs: list[str], every: int = 4) -> list[str]:
    """The documents, each `every`-th followed later by a copy with one word changed (word 5-gram Jaccard ~0.92)."""
    copies = []
    for doc in docs[::every]:
        words = doc.split()
        words[len(words) // 2] = "zeppelin"
        copies.append(" ".join(words))
    return docs + copies


@pytest.mark.parametrize("stage", ["stage", "buckets", "clusters", "pack"])
def test_killed_preparation_resumes_to_the_same_bytes(tmp_path, gpt2_tokenizer, repo_root, stage):
    """kill -9 after a checkpoint of each pass (staging, the near-dup buckets and clusters, packing), then a resume:
    the same bytes as a run never killed."""
    rng = random.Random(5)
    path = write_jsonl(tmp_path / "c.jsonl", with_near_copies(rng, [random_doc(rng) for _ in range(40)]))
    cache = tmp_path / "cache"
    proc = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, str(path), str(cache), stage],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    [folder] = [p for p in cache.iterdir() if p.is_dir()]
    assert not (folder / MANIFEST).exists()  # a killed preparation is never used as it is
    cfg = cfg_for(tmp_path, path, cache_dir=str(cache), val_fraction=0.2, shard_tokens=256, num_proc=2)
    resumed = prepare_dataset(cfg, gpt2_tokenizer)
    fresh = prepare_dataset(
        cfg_for(tmp_path, path, cache_dir=str(tmp_path / "fresh"), val_fraction=0.2, shard_tokens=256, num_proc=1),
        gpt2_tokenizer,
    )
    assert fresh.report["steps"][-1]["in"] - fresh.report["steps"][-1]["out"] == 10  # the planted copies
    names = sorted(p.name for p in fresh.cache_path.glob("*.bin"))
    assert len(names) > 4 and names == sorted(p.name for p in resumed.cache_path.glob("*.bin"))
    for name in names:
        assert (resumed.cache_path / name).read_bytes() == (fresh.cache_path / name).read_bytes(), name
    assert not (resumed.cache_path / "stage").exists()


def test_near_duplicates_are_found_across_files_workers_and_shards(tmp_path, gpt2_tokenizer, monkeypatch):
    """Originals in one file, their near copies in another, read by two workers in batches of 3 documents and
    staged into shards of 300 tokens (120-word documents, one word changed: Jaccard 0.92): every copy is removed,
    every original kept."""
    rng = random.Random(8)
    originals = [random_doc(rng) for _ in range(12)]
    copies = with_near_copies(rng, originals, every=2)[len(originals) :]
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", originals)
    write_jsonl(folder / "b.jsonl", [random_doc(rng) for _ in range(5)] + copies)
    monkeypatch.setattr(data_mod, "BATCH_DOCUMENTS", 3)
    prepared = prepare_dataset(cfg_for(tmp_path, folder, num_proc=2, shard_tokens=300), gpt2_tokenizer)
    near = prepared.report["steps"][-1]
    assert near["in"] - near["out"] == len(copies) == 6
    text = "".join(decoded_documents(prepared, gpt2_tokenizer))
    assert "zeppelin" not in text
    assert all(doc[:60] in text for doc in originals[:-1])  # the last may sit in the dropped tail


def test_local_txt_parquet_and_folder(tmp_path, gpt2_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(6)
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(random_doc(rng))
    pq.write_table(pa.table({"body": [random_doc(rng), random_doc(rng)]}), folder / "sub" / "b.parquet")
    write_jsonl(folder / "c.jsonl", [random_doc(rng)], field="body")
    prepared = prepare_dataset(cfg_for(tmp_path, folder, text_field="body"), gpt2_tokenizer)
    assert prepared.report["steps"][0]["out"] == 4 and prepared.report["documents"] == 4
    with pytest.raises(UserError, match="no column 'text'"):
        prepare_dataset(cfg_for(tmp_path, folder / "sub" / "b.parquet"), gpt2_tokenizer)


def test_builtin_wiki_sample(tmp_path, gpt2_tokenizer):
    cfg = DataConfig(cache_dir=str(tmp_path), max_documents=3, block_size=256)
    assert cfg.dataset == "builtin:wiki" and cfg.val_fraction == 0.05 and cfg.min_doc_chars == 50
    prepared = prepare_dataset(cfg, gpt2_tokenizer)
    text = "".join(decoded_documents(prepared, gpt2_tokenizer))
    assert "Anarchism" in text and "[[" not in text and "'''" not in text and "<ref" not in text
    assert prepared.report["train_blocks"] > 10 and prepared.report["validation_blocks"] >= 1


@pytest.mark.parametrize(
    "texts, kwargs, message",
    [
        (None, {}, "does not exist"),
        (["short", "tiny"], {}, "empty after cleaning"),
        ([], dict(block_size=2048), "larger than the tokenizer's model_max_length 1024"),
    ],
)
def test_bad_inputs(tmp_path, gpt2_tokenizer, texts, kwargs, message):
    path = tmp_path / "missing.jsonl" if texts is None else write_jsonl(tmp_path / "c.jsonl", texts)
    with pytest.raises(UserError, match=message):
        prepare_dataset(cfg_for(tmp_path, path, **kwargs), gpt2_tokenizer)


def test_jsonl_line_without_field_names_file_and_line(tmp_path, gpt2_tokenizer):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"text": "a" * 80}) + "\n\n" + json.dumps({"body": "b" * 80}) + "\n")
    with pytest.raises(UserError, match=rf"{path}:3 has no field 'text'"):
        prepare_dataset(cfg_for(tmp_path, path), gpt2_tokenizer)
    path.write_text(json.dumps({"text": "a" * 80}) + "\n{not json\n")
    with pytest.raises(UserError, match=rf"{path}:2 is not valid JSON"):
        prepare_dataset(cfg_for(tmp_path, path), gpt2_tokenizer)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".parquet"])
def test_non_utf8_input_is_one_line_naming_the_file_and_line_in_every_format(tmp_path, gpt2_tokenizer, suffix):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good, bad = "fine text " * 10, b"caf\xe9 latin-1 " * 10
    path = tmp_path / f"c{suffix}"
    if suffix == ".txt":
        path.write_bytes(good.encode() + b"\n" + bad + b"\n")
        where = f"{path}:2 is not UTF-8"
    elif suffix == ".jsonl":
        path.write_bytes(json.dumps({"text": good}).encode() + b"\n" + b'{"text": "' + bad + b'"}\n')
        where = f"{path}:2 is not UTF-8"
    else:
        pq.write_table(pa.table({"text": pa.array([good.encode(), bad], type=pa.binary())}), path)
        where = f"{path}: row 2 of column 'text' is not UTF-8"
    with pytest.raises(UserError, match=where) as err:
        prepare_dataset(cfg_for(tmp_path, path), gpt2_tokenizer)
    assert "\n" not in str(err.value) and not list((tmp_path / "cache").glob("*/manifest.json"))


def test_unknown_hub_dataset_offline(tmp_path, gpt2_tokenizer):
    assert os.environ.get("HF_DATASETS_OFFLINE") == "1"
    with pytest.raises(UserError, match="connect to the internet.*local .txt/.jsonl/.parquet") as err:
        prepare_dataset(cfg_for(tmp_path, "no-such-org/no-such-dataset-xyz"), gpt2_tokenizer)
    assert "\n" not in str(err.value)


def test_config_validation():
    from llmlab.core.config import build_config

    with pytest.raises(UserError, match="val_fraction"):
        build_config(DataConfig, {"val_fraction": 1.5})
    with pytest.raises(UserError, match="near_dup_threshold"):
        build_config(DataConfig, {"near_dup_threshold": -0.1})
    assert build_config(DataConfig, {"block_size": "256"}).block_size == 256


def test_hub_dataset_columns_split_and_missing_field(tmp_path, gpt2_tokenizer, monkeypatch):
    """The hub path's own logic (split choice, column check, empty rows) on an in-memory stand-in for the hub."""
    import datasets

    rng = random.Random(7)
    train_texts = [random_doc(rng) for _ in range(4)] + [None]
    fake_hub = datasets.DatasetDict(
        {
            "validation": datasets.Dataset.from_dict({"body": [random_doc(rng)], "n": [0]}),
            "train": datasets.Dataset.from_dict({"body": train_texts, "n": list(range(5))}),
        }
    )
    calls = []
    monkeypatch.setattr(
        datasets,
        "load_dataset",
        lambda name, config=None, streaming=False: calls.append((name, config, streaming)) or fake_hub,
    )
    prepared = prepare_dataset(
        cfg_for(tmp_path, "someorg/somecorpus", dataset_config="v1", text_field="body"), gpt2_tokenizer
    )
    assert calls == [("someorg/somecorpus", "v1", True)]  # streamed, never loaded whole
    assert prepared.report["steps"][0]["out"] == 4  # the train split, None row dropped
    assert prepared.cache_path.name.startswith("somecorpus-b32-")
    with pytest.raises(UserError, match="has no column 'text'"):
        prepare_dataset(cfg_for(tmp_path, "someorg/somecorpus", dataset_config="v1"), gpt2_tokenizer)


@pytest.mark.slow  # two interpreter start-ups with torch; ~15 s idle, more on a busy machine
def test_prepare_only_cli_summary_and_one_line_error(tmp_path):
    from tests.conftest import run_script

    rng = random.Random(8)
    path = write_jsonl(tmp_path / "c.jsonl", [random_doc(rng) for _ in range(6)])
    common = [
        "train_pretrain.py",
        "--prepare_only",
        "--output_dir",
        str(tmp_path / "out"),
        "--cache_dir",
        str(tmp_path / "cache"),
        "--block_size",
        "32",
    ]
    ok = run_script([*common, "--dataset", str(path)])
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "exact duplicates" in ok.stdout and "blocks of 32: train" in ok.stdout and "tokens/s" in ok.stdout
    assert ok.stderr.count("\r") <= 2 and ok.stderr.count("Preparing") <= 3  # a pipe gets lines, not frames
    path.write_text(path.read_text() + json.dumps({"content": "x" * 60}) + "\n")
    bad = run_script([*common, "--dataset", str(path)])
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {path}:7 has no field 'text'; give every line that field or pass --text_field NAME"]


def test_near_duplicates_are_found_by_exact_jaccard_with_full_recall_and_precision():
    """Planted edits of long documents, true Jaccard 0.86-0.99 (duplicates) and 0.55-0.80 (not): every
    duplicate removed, nothing else, through the stages' own functions (band keys -> pairs -> clusters)."""
    from llmlab.data import minhash, near_dup

    rng = random.Random(0)
    vocabulary = [f"w{i}" for i in range(3000)]
    originals = [[rng.choice(vocabulary) for _ in range(600)] for _ in range(60)]
    docs, truth = [], []
    for words in originals:
        docs.append(" ".join(words))
        truth.append(False)
    for index, words in enumerate(originals):
        edited = list(words)
        for position in rng.sample(range(len(edited)), rng.choice([1, 2, 3, 5, 8, 25, 40])):
            edited[position] = rng.choice(vocabulary)
        text = " ".join(edited).upper() if index % 2 else " ".join(edited)  # ASCII case does not matter
        similarity = minhash.jaccard(minhash.shingle_set(docs[index]), minhash.shingle_set(text))
        docs.append(text)
        truth.append(similarity >= 0.85)
    planted = sum(truth)
    assert 20 <= planted <= 45 and sum(not t for t in truth[60:]) >= 10  # both kinds are really there
    keys = minhash.band_keys(minhash.signatures(docs))
    pairs = np.concatenate([near_dup.candidate_pairs(keys[:, band]) for band in range(minhash.BANDS)])
    found = set(near_dup.removed_documents(pairs, 0.85, docs.__getitem__).tolist())
    expected = {i for i, dup in enumerate(truth) if dup}
    assert found == expected, (sorted(expected - found), sorted(found - expected))


def test_a_group_of_copies_is_removed_whole_through_its_base():
    """The issue-53 corpus in small: bases of 200 words, each followed later by 5 copies with 1-3 words changed
    (Jaccard 0.85-0.95 to the base, 0.73-0.83 copy to copy). Every copy at >= 0.85 to its base goes, however the
    band keys sort, and no base or unrelated document does."""
    from llmlab.data import minhash, near_dup

    rng = random.Random(1)
    vocabulary = [f"w{i}" for i in range(5000)]
    bases = [[rng.choice(vocabulary) for _ in range(200)] for _ in range(40)]
    docs = [" ".join(words) for words in bases]
    copies = []
    for index, words in enumerate(bases):
        for _ in range(5):
            edited = list(words)
            for position in rng.sample(range(200), rng.randint(1, 3)):
                edited[position] = rng.choice(vocabulary)
            copies.append((index, " ".join(edited)))
    rng.shuffle(copies)  # later in the corpus, in no order
    docs += [text for _, text in copies]
    shingles = [minhash.shingle_set(d) for d in docs]
    to_base = [minhash.jaccard(shingles[40 + k], shingles[base]) for k, (base, _) in enumerate(copies)]
    keys = minhash.band_keys(minhash.signatures(docs))
    pairs = np.concatenate([near_dup.candidate_pairs(keys[:, band]) for band in range(minhash.BANDS)])
    assert len(pairs) <= 2 * len(docs) * minhash.BANDS  # bounded: two pairs a document a band
    found = set(near_dup.removed_documents(pairs, 0.85, docs.__getitem__).tolist())
    expected = {40 + k for k, similarity in enumerate(to_base) if similarity >= 0.85}
    assert len(expected) >= 150 and expected <= found, sorted(expected - found)
    assert not found & set(range(40))  # no base


def test_shingle_hashes_follow_their_definition():
    """Word 5-grams of the ASCII-lower-cased text, words as runs of [a-z0-9_] or non-ASCII bytes: the vectorised
    hashes give the same sets as the definition spelled out in Python, batch or not."""
    import re

    from llmlab.data import minhash

    texts = [
        "The café's crème brûlée, 3 times!",
        "a b c",
        "",
        "x_y  z\nQ w e r t y u",
        "Ünïcode wörds hére and thére ok",
    ]

    def words(text):
        return re.findall(rb"[a-z0-9_\x80-\xff]+", text.encode().lower())

    groups = [
        [tuple(w[i : i + 5]) for i in range(max(len(w) - 4, 1))] if len(w) >= 5 else [tuple(w)]
        for w in map(words, texts)
    ]
    hashes, first = minhash.shingle_hashes(texts)
    for d, shingles in enumerate(groups):
        mine = hashes[first[d] : first[d + 1]]
        assert len(mine) == len(shingles)
        # equal shingles hash equally and different ones differently
        assert len(set(mine.tolist())) == len(set(shingles))
    alone = [minhash.shingle_set(t) for t in texts]
    assert all(np.array_equal(np.unique(hashes[first[d] : first[d + 1]]), alone[d]) for d in range(len(texts)))
    assert (
        minhash.jaccard(
            minhash.shingle_set("One two three four five six"), minhash.shingle_set("ONE two three four five SIX")
        )
        == 1.0
    )


def test_one_small_text_file_splits_within_the_text_and_trains(tmp_path, gpt2_tokenizer, capsys):
    """One 60 KB .txt is one document: whole-document splitting would leave one split empty, so the text itself is
    split (its last blocks validate), with one line saying so; the defaults then train on it."""
    rng = random.Random(3)
    text = tmp_path / "small.txt"
    text.write_text(" ".join(random_doc(rng, 300) for _ in range(30)))
    prepared = prepare_dataset(cfg_for(tmp_path, text, block_size=64, val_fraction=0.05), gpt2_tokenizer)
    assert "blocks of the text are the validation split" in capsys.readouterr().out
    train, val = np.array(prepared.train["input_ids"]), np.array(prepared.validation["input_ids"])
    assert len(train) > 0 and len(val) == max(1, round(0.05 * (len(train) + len(val))))
    stream = np.concatenate([train.ravel(), val.ravel()])  # train then validation is the text in order
    assert prepared.report["split"] == "within the text"
    ids = gpt2_tokenizer(text.read_text())["input_ids"]
    assert stream.tolist() == ids[: len(stream)]
    proc = subprocess.run(
        [
            sys.executable,
            "train_pretrain.py",
            "--dataset",
            str(text),
            "--max_steps",
            "2",
            "--sample_tokens",
            "0",
            "--cache_dir",
            str(tmp_path / "c2"),
            "--output_dir",
            str(tmp_path / "run"),
        ],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert "the last" in proc.stdout and "blocks of the text are the validation split" in proc.stdout


def test_the_fast_gpt2_encoder_gives_transformers_ids(gpt2_tokenizer):
    from llmlab.data.corpus import iter_documents
    from llmlab.data.tokenizer import fast_gpt2_encoder, is_builtin_gpt2

    assert is_builtin_gpt2(gpt2_tokenizer)
    tricky = [
        "Hello  world!\n\n\tTabs",
        "naïve café — “quotes” ½ ﬁ",
        "I'm you'll we've they're it's",
        "    leading",
        "trailing   ",
        "数字 123,456.78 and ١٢٣",
        "emoji 🙂🚀 mixed",
        "<|endoftext|> is text here",
        "a\r\nb\u2028c",
        "".join(chr(c) for c in range(32, 600)),
    ]
    wiki = list(itertools.islice(iter_documents("builtin:wiki", None, "text"), 5))
    fast = fast_gpt2_encoder()
    for text in tricky + wiki:
        expected = gpt2_tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        assert fast.encode_ordinary(text) == expected, text[:40]
    assert gpt2_tokenizer.eos_token_id not in fast.encode_ordinary(tricky[7])  # text never injects an eos


def test_skipping_passes_the_text_does_not_need_changes_nothing():
    """clean_text runs a markup or whitespace pass only when its trigger is in the text; every pass always run
    must give the same text on markup-heavy and plain input."""
    import unicodedata

    from gensim.corpora.wikicorpus import filter_wiki

    from llmlab.data import cleaning
    from llmlab.data.corpus import iter_documents

    def every_pass(text: str) -> str:
        text = unicodedata.normalize("NFKC", text)
        for _needed, markup_pass in cleaning._MARKUP_PASSES:
            text = markup_pass(text)
        text = cleaning._SPACE_AROUND_NEWLINE.sub("\n", cleaning._SPACES.sub(" ", text))
        return cleaning._MANY_NEWLINES.sub("\n\n", text).strip()

    wiki = list(itertools.islice(iter_documents("builtin:wiki", None, "text"), 8))
    tricky = [
        "<b>&lt;b&gt;</b> &amp;#123;&amp;#123;x}} [[a|b]] ==H== ''i'' File:x.jpg|c |alt=d",
        "a \t b\u00a0 c \n d\n\n\n\ne  ",
        "plain prose. one space each.",
        "&#60;script&#62;x&#60;/script&#62;",
    ]
    for text in wiki + [filter_wiki(t) for t in wiki] + tricky:
        assert cleaning.clean_text(text) == every_pass(text), text[:60]


def _compress(path: Path, suffix: str) -> Path:
    import bz2
    import gzip
    import lzma

    import zstandard

    data = path.read_bytes()
    packed = {
        ".gz": gzip.compress,
        ".bz2": bz2.compress,
        ".xz": lzma.compress,
        ".zst": zstandard.ZstdCompressor().compress,
    }[suffix](data)
    target = path.with_name(path.name + suffix)
    target.write_bytes(packed)
    return target


def test_each_compressed_format_prepares_the_same_tokens_as_the_plain_file(tmp_path, gpt2_tokenizer):
    rng = random.Random(11)
    (tmp_path / "plain").mkdir()
    plain = write_jsonl(tmp_path / "plain" / "c.jsonl", [random_doc(rng) for _ in range(12)])
    expected = np.asarray(prepare_dataset(cfg_for(tmp_path, plain), gpt2_tokenizer).train["input_ids"])
    for suffix in (".gz", ".bz2", ".xz", ".zst"):
        folder = tmp_path / suffix.strip(".")
        folder.mkdir()
        (folder / "c.json").write_bytes(plain.read_bytes())  # .json: JSON lines, as C4 ships them
        packed = _compress(folder / "c.json", suffix)
        (folder / "c.json").unlink()
        tokens = np.asarray(prepare_dataset(cfg_for(tmp_path, packed), gpt2_tokenizer).train["input_ids"])
        assert np.array_equal(tokens, expected), suffix
    texts = tmp_path / "texts"  # a folder of compressed .txt files (OpenWebText ships .xz archives of them)
    texts.mkdir()
    for i, doc in enumerate([random_doc(rng) for _ in range(3)]):
        (texts / f"{i}.txt").write_text(doc)
        _compress(texts / f"{i}.txt", ".xz")
        (texts / f"{i}.txt").unlink()
    assert prepare_dataset(cfg_for(tmp_path, texts), gpt2_tokenizer).report["documents"] == 3


def test_a_truncated_or_mislabelled_compressed_file_is_one_line_and_leaves_no_dataset(tmp_path, gpt2_tokenizer):
    rng = random.Random(12)
    plain = write_jsonl(tmp_path / "c.jsonl", [random_doc(rng, 2000) for _ in range(20)])
    packed = _compress(plain, ".gz")
    plain.unlink()
    packed.write_bytes(packed.read_bytes()[: packed.stat().st_size // 2])
    with pytest.raises(UserError, match=rf"{packed} is truncated or corrupt") as err:
        prepare_dataset(cfg_for(tmp_path, packed), gpt2_tokenizer)
    assert "\n" not in str(err.value) and not list((tmp_path / "cache").glob("*/manifest.json"))
    fake = tmp_path / "fake.jsonl.zst"
    fake.write_text(json.dumps({"text": "not compressed at all " * 5}) + "\n")
    with pytest.raises(UserError, match=rf"{fake} is not a .zst file"):
        prepare_dataset(cfg_for(tmp_path, fake), gpt2_tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(json.dumps({"text": "fine text " * 10}).encode() + b"\n" + b'{"text": "caf\xe9 latin-1"}\n')
    bad_xz = _compress(bad, ".xz")
    with pytest.raises(UserError, match=rf"{bad_xz}:2 is not UTF-8"):
        prepare_dataset(cfg_for(tmp_path, bad_xz), gpt2_tokenizer)


POOL_WORKER_SCRIPT = """
import multiprocessing, signal, sys
from llmlab.data import prepare
from llmlab.data.tokenizer import load_tokenizer
signal.signal(signal.SIGTERM, lambda *args: None)  # this process catches SIGTERM and goes on
def worker(ready):
    prepare._init_pool_worker(load_tokenizer(), False, 1, True)  # what each of the pool's workers runs first
    ready.set()
    signal.pause()
ready = multiprocessing.get_context("fork").Event()
child = multiprocessing.get_context("fork").Process(target=worker, args=(ready,))
child.start()
assert ready.wait(60)
child.terminate()  # what Pool.terminate sends each worker still alive
child.join(20)
print("worker exit", child.exitcode, "parent keeps its handler", signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL)
"""


def test_preparation_workers_end_on_sigterm_whatever_their_parent_catches(tmp_path, repo_root):
    """The pool's workers are forked, and Pool.terminate ends them with SIGTERM. They inherited the parent's Python
    handlers, so a handler that does not exit (Ray's, left in a process that once started a Ray node) kept a worker
    alive and the pool's join waiting forever: a CI run hung so, waiting on such a worker. Workers now die on it."""
    proc = subprocess.run(
        [sys.executable, "-c", POOL_WORKER_SCRIPT], cwd=repo_root, capture_output=True, text=True, timeout=120
    )
    assert "worker exit -15 parent keeps its handler True" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_a_corpus_of_one_batch_is_prepared_without_a_pool(monkeypatch):
    """A pool's workers each build the BPE before their first batch, and one batch keeps one busy: a quick run's
    few documents are prepared in the process itself unless --num_proc asks for a pool."""
    monkeypatch.setattr(data_mod, "available_cores", lambda: 4)
    assert data_mod._workers(DataConfig(max_documents=data_mod.BATCH_DOCUMENTS)) == 1
    assert data_mod._workers(DataConfig(max_documents=2 * data_mod.BATCH_DOCUMENTS + 1)) == 3
    assert data_mod._workers(DataConfig(max_documents=10**6)) == data_mod._workers(DataConfig()) == 4
    assert data_mod._workers(DataConfig(max_documents=5, num_proc=2)) == 2


def test_a_long_text_file_streams_in_pieces_that_pack_as_one_document(tmp_path, gpt2_tokenizer):
    """A .txt over MAX_DOCUMENT_CHARS is read in pieces cut after line breaks, each within the limit, that rejoin to
    the text; prepared, the pieces are one document: one eos at its end, nothing between, kept whole in one split,
    and the same tokens as the text tokenised in one go. Pieces are never dropped as short or duplicate (a long
    document of repeated lines keeps every line)."""
    from llmlab.data.corpus import MAX_DOCUMENT_CHARS, Piece, text_file_pieces

    rng = random.Random(5)
    lines = [random_doc(rng, rng.randint(3, 40)) + "\n" for _ in range(9000)]
    long_text = "".join(lines) + "".join(lines[:2000])  # repeats: pieces are parts, never duplicates
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a_long.txt").write_text(long_text)
    others = [random_doc(rng, 150) for _ in range(40)]
    write_jsonl(folder / "b_short.jsonl", others)
    pieces = list(text_file_pieces(folder / "a_long.txt"))
    assert len(pieces) >= 4 and all(isinstance(p, Piece) and len(p) <= MAX_DOCUMENT_CHARS for p in pieces)
    assert "".join(pieces) == long_text and all(p.endswith("\n") for p in pieces[:-1])
    assert [p.continues for p in pieces] == [True] * (len(pieces) - 1) + [False]

    prepared = prepare_dataset(cfg_for(tmp_path, folder, val_fraction=0.3, data_seed=1), gpt2_tokenizer)
    documents = decoded_documents(prepared, gpt2_tokenizer)
    whole = [d for d in documents if d.startswith(long_text[:200])]
    assert len(whole) == 1 and long_text.rstrip().startswith(whole[0])  # one document, whole and in order
    assert len(whole[0]) > 0.9 * len(long_text) and prepared.report["documents"] == 41
    # the same tokens as the text tokenised in one go (pieces are cut after line breaks, where the BPE splits too)
    eos, found = gpt2_tokenizer.eos_token_id, 0
    for split in (prepared.train, prepared.validation):
        ids = [i for row in split["input_ids"] for i in row]
        cuts = [-1] + [k for k, token in enumerate(ids) if token == eos] + [len(ids)]
        for a, b in zip(cuts[:-1], cuts[1:]):
            segment = ids[a + 1 : b]
            if gpt2_tokenizer.decode(segment[:50]) == long_text[: len(gpt2_tokenizer.decode(segment[:50]))]:
                assert segment == gpt2_tokenizer(long_text.rstrip())["input_ids"][: len(segment)]
                found += 1
    assert found == 1


def test_a_json_line_over_the_limit_is_refused_before_it_is_read_whole(tmp_path, gpt2_tokenizer, monkeypatch):
    from llmlab.data import corpus

    monkeypatch.setattr(corpus, "MAX_JSON_LINE_BYTES", 4096)
    path = write_jsonl(tmp_path / "c.jsonl", ["short text " * 10, "x" * 10_000, "more"])
    with pytest.raises(UserError, match=r"c.jsonl:2 is a line of over 0 MB.*\.txt files"):
        prepare_dataset(cfg_for(tmp_path, path), gpt2_tokenizer)


def test_reading_a_half_gigabyte_one_document_file_keeps_memory_flat(tmp_path):
    """Peak RSS of a process that streams a 0.5 GB one-document .txt.gz (one line per 80 characters, and one line of
    64 MB) through the corpus reader, against the same process reading a 1 MB one: within 150 MB."""
    import gzip

    block = ("".join(f"line {i} of a corpus that someone concatenated into one file\n" for i in range(16_000))).encode()
    member = gzip.compress(block * ((16 << 20) // len(block)), compresslevel=1)  # 16 MB of text
    big = tmp_path / "big.txt.gz"
    with open(big, "wb") as f:  # a gzip of several members is one stream to every reader: 0.5 GB, written fast
        f.write(member * 32)
        f.write(gzip.compress(b"y" * (64 << 20) + b"\n"))  # one 64 MB line: read in bounded chunks too
    small = tmp_path / "small.txt.gz"
    with gzip.open(small, "wb") as f:
        f.write(block[: 1 << 20])
    code = (
        "import resource, sys; from pathlib import Path; from llmlab.data.corpus import text_file_pieces; "
        "n = sum(len(p) for p in text_file_pieces(Path(sys.argv[1]))); "
        "print(n, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)"
    )
    peaks = {}
    for name, path in (("small", small), ("big", big)):
        proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        characters, peaks[name] = (int(v) for v in proc.stdout.split())
    assert characters > 500 << 20
    assert peaks["big"] - peaks["small"] < 150, peaks


def test_a_corpus_too_small_to_train_says_why_in_one_line(tmp_path, gpt2_tokenizer):
    """300 copies of one 110-token document dedup to one document: the error names the tokens, blocks and what to
    pass (it was an errno from reading zero blocks)."""
    text = "The quick brown fox jumps over the lazy dog near the river bank on a sunny day. " * 6
    path = write_jsonl(tmp_path / "c.jsonl", [text] * 300)
    with pytest.raises(UserError) as info:
        prepare_dataset(cfg_for(tmp_path, path, block_size=128, val_fraction=0.1), gpt2_tokenizer)
    message = str(info.value)
    assert "\n" not in message and "Errno" not in message
    assert "109 tokens in 1 document(s)" in message and "299 exact duplicates" in message
    assert "0 block(s) of --block_size 128" in message and "lower --block_size to 54 or less" in message
