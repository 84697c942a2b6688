"""Instruction data for LoRA: builtin:pydoc (llmlab.data.pydoc_qa), JSONL/JSON/hub loading, prompts, tokenisation.

A record is {"instruction", "input", "output"} (input may be empty). `tokenize_example` turns one into
`input_ids` + `labels` where every prompt token is labelled -100, so the loss only sees the answer and
the eos after it. Padding (`collate`) gets label -100 too; the pad *id* may equal eos (GPT-2 has no pad
token), which is harmless because labels are built from positions, never by comparing ids to pad.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from llmlab.core.errors import UserError
from llmlab.core.io import utf8_lines
from llmlab.data.pydoc_qa import load_pydoc

REQUIRED_FIELDS = ("instruction", "output")  # "input" may be missing or empty

DEFAULT_PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
DEFAULT_PROMPT_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"
# train_lora.py saves its prompt templates under this name next to the adapter; merge copies it, generate reads it
PROMPT_FILE = "llmlab_prompt.json"


# --------------------------------------------------------------------------------------------------
# Loading user data: JSONL, JSON, or a hub dataset, with schema errors that name the file and line
# --------------------------------------------------------------------------------------------------


def _check_record(record: Any, where: str) -> dict[str, str]:
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object with instruction/input/output, got {type(record).__name__}")
    for name in REQUIRED_FIELDS:
        if name not in record or record[name] is None:
            raise UserError(
                f"{where}: missing field '{name}' (each record needs instruction, output and optionally input)"
            )
    clean = {}
    for name in ("instruction", "input", "output"):
        value = record.get(name) or ""
        if not isinstance(value, str):
            raise UserError(f"{where}: field '{name}' must be a string, got {type(value).__name__}")
        clean[name] = value
    for name in REQUIRED_FIELDS:
        if not clean[name].strip():
            raise UserError(f"{where}: field '{name}' is empty")
    return clean


def _read_instruction_jsonl(path: Path) -> list[dict[str, str]]:
    records = []
    for lineno, line in utf8_lines(path):  # non-UTF-8 bytes are a one-line error naming the line
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{lineno}: not valid JSON ({err.msg}); each line must be one JSON object") from None
        records.append(_check_record(record, f"{path}:{lineno}"))
    return records


def _read_json(path: Path) -> list[dict[str, str]]:
    """A JSON array of records; each element is decoded on its own so errors can name its line."""
    text = "".join(line for _, line in utf8_lines(path))
    decoder = json.JSONDecoder()

    def line_of(pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    def skip_ws(pos: int) -> int:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        return pos

    pos = skip_ws(0)
    if pos >= len(text) or text[pos] != "[":
        raise UserError(f"{path}:{line_of(pos)}: expected a JSON array of records (or use .jsonl, one per line)")
    records, pos = [], skip_ws(pos + 1)
    while pos < len(text) and text[pos] != "]":
        try:
            record, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{line_of(err.pos)}: not valid JSON ({err.msg})") from None
        records.append(_check_record(record, f"{path}:{line_of(pos)}"))
        pos = skip_ws(end)
        if pos < len(text) and text[pos] == ",":
            pos = skip_ws(pos + 1)
        elif pos < len(text) and text[pos] != "]":
            raise UserError(f"{path}:{line_of(pos)}: not valid JSON (expected ',' or ']')")
    if pos >= len(text):
        raise UserError(f"{path}:{line_of(len(text))}: not valid JSON (unterminated array)")
    return records


def _load_hub_instructions(name: str, config: str | None, split: str) -> list[dict[str, str]]:
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as err:  # offline, typo, missing split: all surface as one line
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise UserError(
            f"cannot load dataset {name!r} ({first}); pass a local .jsonl/.json file or builtin:pydoc"
        ) from None
    missing = [c for c in REQUIRED_FIELDS if c not in ds.column_names]
    if missing:
        raise UserError(
            f"dataset {name!r}: missing column '{missing[0]}' (has {', '.join(ds.column_names)}); "
            "it needs instruction, output and optionally input"
        )
    return [_check_record(row, f"{name} row {i}") for i, row in enumerate(ds)]


def load_records(
    dataset: str,
    cache_dir: str | os.PathLike = "cache",
    dataset_config: str | None = None,
    dataset_split: str = "train",
) -> list[dict[str, str]]:
    """builtin:pydoc, a .jsonl/.json file, or a hub dataset name/folder with instruction/input/output columns."""
    if dataset == "builtin:pydoc":
        return load_pydoc(cache_dir)
    if dataset.startswith("builtin:"):
        raise UserError(f"unknown builtin dataset {dataset!r}; the builtin instruction set is builtin:pydoc")
    path = Path(dataset)
    if path.suffix in (".jsonl", ".json"):
        if not path.is_file():
            raise UserError(f"dataset file {path} not found; pass an existing .jsonl/.json file or builtin:pydoc")
        records = _read_instruction_jsonl(path) if path.suffix == ".jsonl" else _read_json(path)
        if not records:
            raise UserError(f"dataset file {path} holds no records")
        return records
    return _load_hub_instructions(dataset, dataset_config, dataset_split)


def split_records(records: list, val_fraction: float, seed: int, max_records: int | None = None) -> tuple[list, list]:
    """Seeded shuffle (optionally keeping only `max_records`), then the last `val_fraction` is validation."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    order = order[:max_records] if max_records else order
    if len(order) < 2:
        raise UserError(f"need at least 2 records to make a train/validation split, got {len(order)}")
    n_val = min(len(order) - 1, max(1, round(len(order) * val_fraction)))
    return [records[i] for i in order[:-n_val]], [records[i] for i in order[-n_val:]]


def split_three(
    records: list, val_fraction: float, test_fraction: float, seed: int, max_records: int | None = None
) -> tuple[list, list, list]:
    """Seeded shuffle (optionally keeping only `max_records`), then the last `test_fraction` is a test split that no
    training choice ever sees, and the last `val_fraction` of the rest is validation (early stopping, selection)."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    order = order[:max_records] if max_records else order
    n_test = round(len(order) * test_fraction) if test_fraction > 0 else 0
    if n_test and len(order) - n_test < 2:
        raise UserError(
            f"{len(order)} records leave fewer than 2 for training and validation after the "
            f"--test_fraction {test_fraction:g} test split; use more records or a smaller --test_fraction"
        )
    kept, test = order[: len(order) - n_test], order[len(order) - n_test :]
    if len(kept) < 2:
        raise UserError(f"need at least 2 records to make a train/validation split, got {len(kept)}")
    n_val = min(len(kept) - 1, max(1, round(len(kept) * val_fraction)))
    return ([records[i] for i in kept[:-n_val]], [records[i] for i in kept[-n_val:]], [records[i] for i in test])


# --------------------------------------------------------------------------------------------------
# Prompts, tokenisation with prompt masking, padding
# --------------------------------------------------------------------------------------------------


def check_templates(prompt_template: str, prompt_template_no_input: str) -> None:
    for flag, template, fields in (
        ("prompt_template", prompt_template, ("instruction", "input")),
        ("prompt_template_no_input", prompt_template_no_input, ("instruction",)),
    ):
        try:
            template.format(instruction="x", input="y")
        except (KeyError, IndexError, ValueError) as err:
            raise UserError(
                f"--{flag}: bad placeholder {err}; use {{instruction}} and {{input}} "
                "(double other braces: {{{{ }}}})"
            ) from None
        for field in fields:
            if f"{{{field}}}" not in template:
                raise UserError(f"--{flag}: the template must contain {{{field}}}")


def format_prompt(
    record: dict[str, str],
    prompt_template: str = DEFAULT_PROMPT,
    prompt_template_no_input: str = DEFAULT_PROMPT_NO_INPUT,
) -> str:
    template = prompt_template if record.get("input", "").strip() else prompt_template_no_input
    return template.format(instruction=record["instruction"].strip(), input=record.get("input", "").strip())


def tokenize_example(tokenizer, prompt: str, answer: str, max_length: int) -> dict[str, list[int]] | None:
    """input_ids = prompt + answer + eos; labels = -100 on the prompt, the ids on answer + eos.

    A too-long answer is cut (and then gets no eos: the model must not learn to stop mid-sentence);
    an example whose prompt alone leaves no room for 8 answer tokens is dropped (returns None).
    """
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    room = max_length - len(prompt_ids)
    if room < min(8, len(answer_ids)):
        return None
    answer_ids = answer_ids[:room]
    return {
        "input_ids": prompt_ids + answer_ids,
        "labels": [-100] * len(prompt_ids) + answer_ids,
        "prompt_length": len(prompt_ids),
    }


def tokenize_records(
    tokenizer, records: list[dict[str, str]], max_length: int, prompt_template: str, prompt_template_no_input: str
) -> tuple[list[dict], int]:
    """Tokenised examples (each keeps its record) and how many were dropped as too long."""
    examples, dropped = [], 0
    for record in records:
        example = tokenize_example(
            tokenizer,
            format_prompt(record, prompt_template, prompt_template_no_input),
            record["output"].strip(),
            max_length,
        )
        if example is None:
            dropped += 1
            continue
        example["record"] = record
        examples.append(example)
    return examples, dropped


def pad_id_for(tokenizer) -> int:
    """The id used to fill padded *inputs*: the tokenizer's pad token, else eos (GPT-2 has no pad).

    Padded positions always get attention 0 and label -100, so reusing eos as filler never hides the
    real eos after an answer from the loss.
    """
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def collate(examples: list[dict], pad_id: int) -> dict[str, Any]:
    """Right-pad a batch for training/loss: attention 0 and label -100 on padding."""
    import torch

    width = max(len(e["input_ids"]) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        input_ids[row, :n] = torch.tensor(example["input_ids"])
        labels[row, :n] = torch.tensor(example["labels"])
        attention[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def collate_prompts(examples: list[dict], pad_id: int) -> dict[str, Any]:
    """Left-pad the prompts only, for batched generation (new tokens then line up on the right)."""
    import torch

    prompts = [e["input_ids"][: e["prompt_length"]] for e in examples]
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention[row, width - len(prompt) :] = 1
    return {"input_ids": input_ids, "attention_mask": attention}
