"""Downstream evaluation through lm-evaluation-harness, offline: the builtin multiple-choice task scored by the harness
equals a by-hand computation on the same items, and the trainers and merge_and_infer.py report it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from llmlab.core.errors import UserError
from llmlab.data.choice_tasks import PYDOC_MC, choice_items
from llmlab.data.pydoc_qa import build_pydoc_records
from llmlab.data.tokenizer import load_tokenizer
from llmlab.infer.downstream import evaluate_tasks, task_manager

MODULES = ["json", "textwrap", "shutil", "string", "heapq", "bisect", "fnmatch", "base64"]


@pytest.fixture(scope="module")
def records():
    return build_pydoc_records(MODULES)


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=256)
    return transformers.GPT2LMHeadModel(config).eval()


def by_hand(model, tokenizer, items: list[dict]) -> tuple[float, float]:
    """acc and acc_norm as lm-eval defines them: the sum of the log-probs of ' ' + choice after the question, its
    argmax (acc) and its argmax per character of the choice (acc_norm)."""
    acc = norm = 0
    for item in items:
        context = tokenizer(f"Question: {item['question']}\nAnswer:")["input_ids"]
        scores = []
        for choice in item["choices"]:
            continuation = tokenizer(" " + choice)["input_ids"]
            ids = torch.tensor([context + continuation])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            targets = ids[0, 1:]
            scores.append(float(logprobs[len(context) - 1 :].gather(1, targets[len(context) - 1 :, None]).sum()))
        lengths = np.array([len(c) for c in item["choices"]], dtype=float)
        acc += int(np.argmax(scores) == item["label"])
        norm += int(np.argmax(np.array(scores) / lengths) == item["label"])
    return acc / len(items), norm / len(items)


def test_the_harness_scores_the_offline_task_as_a_by_hand_computation(tmp_path, records, tiny_model):
    tokenizer = load_tokenizer()
    scores = evaluate_tasks(tiny_model, tokenizer, [PYDOC_MC], tmp_path, pydoc_records=records)[PYDOC_MC]
    items = [json.loads(line) for line in (tmp_path / "pydoc-mc" / "items.jsonl").read_text().splitlines()]
    assert items == choice_items(records, 200, 4, 0) and scores["n"] == len(items) == len(records)
    acc, acc_norm = by_hand(tiny_model, tokenizer, items)
    assert scores["acc"] == pytest.approx(acc, abs=1e-9) and scores["acc_norm"] == pytest.approx(acc_norm, abs=1e-9)
    assert scores["acc_stderr"] == pytest.approx(np.sqrt(acc * (1 - acc) / (len(items) - 1)), rel=1e-6)
    assert not tiny_model.training  # the harness leaves the model in the mode it found it
    hits = task_manager.cache_info().hits
    manager = task_manager((str(tmp_path / "pydoc-mc"),), with_bundled=False)
    assert task_manager.cache_info().hits == hits + 1  # the index that evaluation used
    assert "hellaswag" not in manager.all_tasks  # built without lm-eval's ~15k bundled task files


def test_a_hub_task_while_offline_and_an_unknown_task_are_one_line(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = load_tokenizer()
    task_manager.cache_clear()
    with pytest.raises(UserError, match="hellaswag need data from the Hugging Face hub") as err:
        evaluate_tasks(tiny_model, tokenizer, ["hellaswag"], tmp_path, limit=2)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="no task 'no_such_task'"):
        evaluate_tasks(tiny_model, tokenizer, ["no_such_task"], tmp_path)
    assert task_manager.cache_info().misses == 1  # lm-eval's bundled index, built once for both


def test_pretraining_reports_the_tasks_and_merge_and_infer_eval_scores_its_final_model(tmp_path, pretrain_cache):
    """--eval_tasks every 2 steps and at the end (once, not twice at the last step), into metrics.jsonl and
    TensorBoard; `merge_and_infer.py eval` on the saved final model gives the trainer's final scores."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.conftest import run_in_process
    from tests.train.test_pretrain import SMALL

    run = tmp_path / "run"
    args = [
        "train_pretrain.py",
        *SMALL,
        "--max_steps",
        "4",
        "--eval_every",
        "4",
        "--save_every",
        "100",
        "--cache_dir",
        str(pretrain_cache),
        "--output_dir",
        str(run),
        "--eval_tasks",
        PYDOC_MC,
        "--eval_tasks_every",
        "2",
        "--eval_tasks_limit",
        "8",
        "--mixed_precision",
        "no",
    ]
    proc = run_in_process(args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Running loglikelihood" not in proc.stderr + proc.stdout  # no per-request bars in a training log
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in rows if f"downstream/{PYDOC_MC}/acc" in r]
    assert [r["step"] for r in scored] == [2, 4]
    events = EventAccumulator(str(next((run / "tensorboard").rglob("events.out.tfevents.*")).parent)).Reload()
    assert [e.step for e in events.Scalars(f"downstream/{PYDOC_MC}/acc_norm")] == [2, 4]
    out = tmp_path / "eval.json"
    proc = run_in_process(
        [
            "merge_and_infer.py",
            "eval",
            "--model",
            str(run / "final"),
            "--limit",
            "8",
            "--output",
            str(out),
            "--work_dir",
            str(tmp_path / "ds"),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    scores = json.loads(out.read_text())["tasks"][PYDOC_MC]
    assert scores["n"] == 8 and f"| {PYDOC_MC} | 8 |" in proc.stdout
    for metric in ("acc", "acc_norm"):
        assert scores[metric] == pytest.approx(scored[-1][f"downstream/{PYDOC_MC}/{metric}"], abs=1e-9)


@pytest.mark.parametrize(
    "args, message",
    [
        (["train_pretrain.py", "--eval_tasks_every", "-1"], "--eval_tasks_every must be >= 0"),
        (["train_pretrain.py", "--eval_tasks_limit", "0"], "--eval_tasks_limit >= 1"),
        (["merge_and_infer.py", "eval", "--model", "gpt2", "--limit", "0"], "--limit and --batch_size must be >= 1"),
        (
            [
                "sweep.py",
                "--grid",
                "lr_bs",
                "--model",
                "minimal",
                "--sizes",
                "32x2",
                "64x2",
                "--new_machine_blocks",
                "0",
            ],
            "--new_machine_blocks must be >= 1",
        ),
    ],
)
def test_this_sessions_new_options_refuse_bad_values_in_one_line(args, message):
    from tests.conftest import run_script

    proc = run_script(args, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def broken_task(folder) -> str:
    """A local task YAML whose first item is sound and whose fourth has no choices: it loads (lm-eval checks the
    first item), and its evaluation then fails, as a task can after hours of training."""
    rows = [{"question": "What is 1?", "choices": ["a", "b", "c", "d"], "label": 0}] * 3
    rows.append({"question": "What is 2?", "choices": None, "label": 1})
    (folder / "items.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    path = folder / "broken_task.yaml"
    path.write_text(
        "task: llmlab_broken\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(folder / 'items.jsonl'))}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return str(path)


def test_a_task_that_cannot_work_is_refused_before_any_training_or_model_load(tmp_path, tiny_gpt2_dir, monkeypatch):
    """A task that cannot work costs seconds, not a run: train_pretrain.py refuses before its run folder exists (a
    real process), and the check, which merge_and_infer.py eval also makes before it loads the model, names a typo
    and a hub task offline in one line each."""
    from llmlab.core.config import parse_config
    from llmlab.infer import evaluate
    from llmlab.infer.config import EvalConfig
    from llmlab.infer.downstream import check_tasks
    from tests.conftest import run_script, tiny_pretrain_args

    missing = tmp_path / "missing_task.yaml"  # a file task: refused before lm-eval's 10 s task index is built
    proc = run_script(
        ["train_pretrain.py", *tiny_pretrain_args(max_steps=20, eval_tasks=missing, output_dir=tmp_path / "run")]
    )
    assert proc.returncode == 2 and f"task file {missing} does not exist" in proc.stderr.splitlines()[-1]
    assert "Traceback" not in proc.stderr and "pretrain:" not in proc.stderr  # no training step ran
    assert not (tmp_path / "run").exists()
    with pytest.raises(UserError, match="lm-eval knows no task 'no_such_task'"):
        check_tasks(["no_such_task"])
    with pytest.raises(UserError, match="need data from the Hugging Face hub and it cannot be reached"):
        check_tasks(["hellaswag"])
    monkeypatch.setattr(evaluate, "load_from_config", lambda *a, **k: pytest.fail("the model loaded first"))
    cfg = parse_config(EvalConfig, ["--model", str(tiny_gpt2_dir), "--tasks", "no_such_task"])
    with pytest.raises(UserError, match="knows no task 'no_such_task'"):
        evaluate.run_eval(cfg)


@pytest.mark.slow
def test_an_evaluation_that_fails_never_costs_training(tmp_path):
    """--eval_tasks_every with a task that loads but fails to evaluate: each step's checkpoint is written before its
    evaluation, a failed periodic evaluation is an event and training goes on to the end, and the final
    evaluation's failure ends the run in one line after final/ is saved."""
    from llmlab.core.io import read_jsonl
    from tests.conftest import run_script, tiny_pretrain_args

    out = tmp_path / "run"
    args = tiny_pretrain_args(
        max_steps=4, eval_tasks=broken_task(tmp_path), eval_tasks_every=2, save_every=2, keep_last=5, output_dir=out
    )
    proc = run_script(["train_pretrain.py", *args, "--sample_tokens", "0"], timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the final evaluation on --eval_tasks failed") and str(out / "final") in last
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_4"]
    assert (out / "final" / "model.safetensors").is_file()
    failed = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "eval_tasks_failed"]
    assert [e["step"] for e in failed] == [2, 4] and "TypeError" in failed[0]["error"]
    assert proc.stdout.count("training goes on") == 2
    losses = {r["step"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r}
    assert losses == {1, 2, 3, 4}  # every step trained
