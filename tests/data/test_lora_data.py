"""instruct_data: the builtin:pydoc builder, schema errors, prompt masking and padding (all in-process, fast)."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from llmlab.core.errors import UserError
from llmlab.data.instruct import (
    DEFAULT_PROMPT,
    DEFAULT_PROMPT_NO_INPUT,
    check_templates,
    collate,
    collate_prompts,
    format_prompt,
    load_records,
    split_records,
    tokenize_example,
)
from llmlab.data.pydoc_qa import build_pydoc_records, load_pydoc, pydoc_cache_path
from llmlab.train.loss import causal_lm_loss


def test_pydoc_pairs_are_real_docstrings():
    records = build_pydoc_records(["json", "textwrap"])
    by_question = {r["instruction"]: r for r in records}
    dumps = by_question["What does `json.dumps` do?"]
    import json as json_module

    first_paragraph = " ".join(inspect.cleandoc(json_module.dumps.__doc__).split("\n\n")[0].split())
    assert dumps["output"] == first_paragraph == "Serialize ``obj`` to a JSON formatted ``str``."
    assert dumps["input"].startswith("json.dumps(obj, *, skipkeys=False")
    assert "What is the `json.JSONDecoder` class for?" in by_question
    assert by_question["What does `textwrap.dedent` do?"]["output"].startswith("Remove any common leading whitespace")
    # json re-exports nothing twice, and no answer text appears under two questions
    assert len({r["instruction"] for r in records}) == len(records)
    assert len({r["output"] for r in records}) == len(records)
    assert all(len(r["output"]) >= 20 and set(r) == {"instruction", "input", "output"} for r in records)
    # private names and imported helpers are not questions
    assert not any("`json._" in r["instruction"] or "json.decoder.scanstring" in r["instruction"] for r in records)


@pytest.fixture(scope="module")
def pydoc_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("pydoc_cache")
    return cache, load_pydoc(cache)


def test_full_pydoc_build_is_cached_deterministic_and_about_4k(pydoc_cache, tmp_path):
    cache, records = pydoc_cache
    assert 3000 <= len(records) <= 6000
    assert len({r["output"] for r in records}) == len(records)
    assert len({r["instruction"] for r in records}) == len(records)
    questions = {r["instruction"] for r in records}
    for known in (
        "What does `json.dumps` do?",
        "What does `os.path.join` do?",
        "What does `math.sqrt` do?",
        "What is the `collections.OrderedDict` class for?",
    ):
        assert known in questions, known
    assert not any(bad in q for q in questions for bad in ("`antigravity", "`this.", "`tkinter", "`idlelib"))
    # defaults such as cgi.FieldStorage(environ=os.environ) must not copy this machine's environment in
    assert not any("environ({" in r["input"] or str(__import__("os").getcwd()) in r["input"] for r in records)
    path = pydoc_cache_path(cache)
    assert path.is_file() and not [p for p in cache.iterdir() if p.name.endswith(".tmp")]
    # Rebuilt from scratch elsewhere: byte-identical (reproducible), and loading reuses the cache.
    again = tmp_path / "again"
    assert load_pydoc(again) == records
    assert pydoc_cache_path(again).read_bytes() == path.read_bytes()


def test_jsonl_schema_errors_name_file_line_and_field(tmp_path):
    good = {"instruction": "Say hi", "input": "", "output": "hi"}
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({"instruction": "x", "input": "y"}) + "\n")
    with pytest.raises(UserError, match=r"data\.jsonl:3: missing field 'output'"):
        load_records(str(path))
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(UserError, match=r"data\.jsonl:2: not valid JSON"):
        load_records(str(path))
    path.write_text(json.dumps({"instruction": "x", "output": 3}) + "\n")
    with pytest.raises(UserError, match=r"data\.jsonl:1: field 'output' must be a string"):
        load_records(str(path))
    path.write_text(json.dumps({"instruction": "x", "output": "y"}) + "\n")  # input may be missing
    assert load_records(str(path)) == [{"instruction": "x", "input": "", "output": "y"}]


def test_json_array_schema_errors_name_the_records_line(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[\n  {"instruction": "a", "input": "", "output": "b"},\n  {"input": "",\n   "output": "d"}\n]\n')
    with pytest.raises(UserError, match=r"data\.json:3: missing field 'instruction'"):
        load_records(str(path))
    path.write_text('[{"instruction": "a", "input": "", "output": "b"}, {"instruction": "c", "output": "d"}]')
    assert [r["instruction"] for r in load_records(str(path))] == ["a", "c"]
    with pytest.raises(UserError, match="not found"):
        load_records(str(tmp_path / "missing.jsonl"))
    with pytest.raises(UserError, match="builtin:pydoc"):
        load_records("builtin:nope")


def test_hub_dataset_missing_column_is_named(tmp_path):
    folder = tmp_path / "hub_like"
    folder.mkdir()
    (folder / "train.jsonl").write_text(json.dumps({"instruction": "q", "answer": "a"}) + "\n")
    with pytest.raises(UserError, match="missing column 'output'"):
        load_records(str(folder))


def test_prompt_mask_labels_only_answer_and_eos(gpt2_tokenizer):
    tok = gpt2_tokenizer
    record = {
        "instruction": "What does `len` do?",
        "input": "len(obj, /)",
        "output": "Return the number of items in a container.",
    }
    prompt = format_prompt(record)
    assert prompt == DEFAULT_PROMPT.format(instruction=record["instruction"], input=record["input"])
    example = tokenize_example(tok, prompt, record["output"], max_length=128)
    n_prompt = len(tok(prompt)["input_ids"])
    answer_ids = tok(record["output"], add_special_tokens=False)["input_ids"]
    assert example["prompt_length"] == n_prompt
    assert example["labels"][:n_prompt] == [-100] * n_prompt
    assert example["labels"][n_prompt:] == answer_ids + [tok.eos_token_id]
    assert example["input_ids"][n_prompt:] == answer_ids + [tok.eos_token_id]

    short = tokenize_example(tok, format_prompt({"instruction": "Hi?", "input": "", "output": "x"}), "Hello.", 128)
    # GPT-2 has no pad token: padding reuses eos as *input* filler, yet the real eos keeps its label.
    pad_id = tok.eos_token_id
    batch = collate([example, short], pad_id)
    row = batch["labels"][1]
    n = len(short["input_ids"])
    assert row[n - 1] == tok.eos_token_id and (row[n:] == -100).all()
    assert (batch["input_ids"][1, n:] == pad_id).all() and (batch["attention_mask"][1, n:] == 0).all()
    assert int((batch["labels"][0] != -100).sum()) == len(answer_ids) + 1

    # Behaviour, not just structure: logits at prompt/pad positions do not move the loss; the eos one does.
    torch.manual_seed(0)
    logits = torch.randn(2, batch["input_ids"].shape[1], len(tok))
    labels = batch["labels"]
    base = causal_lm_loss(logits, labels)
    changed = logits.clone()
    changed[0, : n_prompt - 1] += 100 * torch.randn_like(changed[0, : n_prompt - 1])  # predicting prompt tokens
    changed[1, n - 1 :] += 100  # positions after the eos: padding
    assert torch.allclose(causal_lm_loss(changed, labels), base)
    eos_position = changed.clone()
    eos_position[1, n - 2] += 100 * torch.randn(len(tok))  # the position that predicts the eos
    assert not torch.allclose(causal_lm_loss(eos_position, labels), base)


def test_truncation_and_templates(gpt2_tokenizer):
    tok = gpt2_tokenizer
    long_answer = "word " * 200
    cut = tokenize_example(tok, "Q:\n", long_answer, max_length=32)
    assert len(cut["input_ids"]) == 32 and tok.eos_token_id not in cut["labels"]  # cut answers never "stop"
    assert tokenize_example(tok, "prompt " * 40, "answer", max_length=32) is None
    assert format_prompt({"instruction": "Do it", "input": "", "output": "x"}) == DEFAULT_PROMPT_NO_INPUT.format(
        instruction="Do it"
    )
    with pytest.raises(UserError, match="must contain {input}"):
        check_templates("Q: {instruction}\nA:", DEFAULT_PROMPT_NO_INPUT)
    with pytest.raises(UserError, match="bad placeholder"):
        check_templates("{instruction} {input} {oops}", DEFAULT_PROMPT_NO_INPUT)
    prompts = collate_prompts([cut, tokenize_example(tok, "Longer prompt here:\n", "a b", 32)], tok.eos_token_id)
    assert prompts["attention_mask"][0, 0] == 0 and prompts["attention_mask"][:, -1].all()  # left padded


def test_split_is_seeded_90_10_and_disjoint():
    records = [{"instruction": str(i), "input": "", "output": str(i)} for i in range(100)]
    train, val = split_records(records, 0.1, seed=7)
    assert (len(train), len(val)) == (90, 10)
    assert split_records(records, 0.1, seed=7) == (train, val)
    assert split_records(records, 0.1, seed=8)[1] != val
    assert not {r["instruction"] for r in train} & {r["instruction"] for r in val}
    small_train, small_val = split_records(records, 0.1, seed=7, max_records=20)
    assert (len(small_train), len(small_val)) == (18, 2)
