"""builtin:pydoc-mc -- an offline multiple-choice task for lm-evaluation-harness, built from the installed Python
standard library.

Each item asks what a stdlib object does ("What does `json.dumps` do?") and offers its docstring's first sentence
among distractors drawn from other objects' sentences, in a seeded order. It is written as a JSONL file plus an
lm-eval task YAML (`dataset_path: json`), so the harness scores it like any of its own tasks (acc, acc_norm) with no
download. It measures whether a model prefers the right description, which the LoRA domain data teaches.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from llmlab.core.io import atomic_write_text

PYDOC_MC = "builtin:pydoc-mc"
TASK_NAME = "llmlab_pydoc_mc"
MAX_CHOICE_CHARS = 100


def first_sentence(text: str) -> str:
    return text.split(". ")[0].strip().rstrip(".")[:MAX_CHOICE_CHARS]


def choice_items(records: list[dict], items: int, choices: int, seed: int) -> list[dict]:
    """Up to `items` questions with `choices` options each, the right one at a seeded position."""
    rng = random.Random(seed)
    answers = [first_sentence(r["output"]) for r in records]
    unique = sorted(set(answers))
    picked = rng.sample(range(len(records)), min(items, len(records)))
    out = []
    for index in picked:
        right = answers[index]
        wrong = rng.sample([a for a in unique if a != right], choices - 1)
        options = wrong + [right]
        rng.shuffle(options)
        out.append({"question": records[index]["instruction"], "choices": options, "label": options.index(right)})
    return out


def task_yaml(data_file: Path) -> str:
    return (
        f"task: {TASK_NAME}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data_file))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\n'
        "metric_list:\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
    )


def write_pydoc_choice_task(
    folder: Path, records: list[dict], items: int = 200, choices: int = 4, seed: int = 0
) -> tuple[str, Path]:
    """The task's items and YAML in `folder` (each written atomically); returns the task name and the folder to give
    lm-eval's TaskManager as an include path."""
    folder.mkdir(parents=True, exist_ok=True)
    data_file = folder / "items.jsonl"
    rows = choice_items(records, items, choices, seed)
    atomic_write_text(data_file, "".join(json.dumps(row) + "\n" for row in rows))
    atomic_write_text(folder / f"{TASK_NAME}.yaml", task_yaml(data_file))
    return TASK_NAME, folder
