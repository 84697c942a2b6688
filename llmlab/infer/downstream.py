"""Downstream scores through lm-evaluation-harness, the package the field reports GPT-2's HellaSwag with.

The live model and tokenizer go to the harness in memory (`HFLM(pretrained=model)`, `lm_eval.simple_evaluate`):
nothing is saved first. A task is an lm-eval task name (`hellaswag`, ...), a task YAML file of your own, or
`builtin:pydoc-mc` (llmlab.data.choice_tasks, offline). A task whose data must come from the hub while this machine
is offline is one line saying so.
"""

from __future__ import annotations

import functools
import math
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import yaml

from llmlab.core.errors import UserError
from llmlab.core.io import llmlab_cache
from llmlab.data.choice_tasks import PYDOC_MC, write_pydoc_choice_task
from llmlab.data.pydoc_qa import load_pydoc

METRICS = ("acc", "acc_norm")


def resolve_tasks(tasks: list[str], work_dir: Path, pydoc_records=None) -> tuple[list[str], list[str]]:
    """lm-eval task names and the include paths their YAML files live in."""
    names, include = [], []
    for task in tasks:
        if task == PYDOC_MC:
            if pydoc_records is None:
                pydoc_records = load_pydoc(llmlab_cache("data"))  # where train_lora.py keeps builtin:pydoc
            name, folder = write_pydoc_choice_task(work_dir / "pydoc-mc", pydoc_records)
            names.append(name)
            include.append(str(folder))
        elif task.endswith((".yaml", ".yml")):
            path = Path(task).expanduser()
            if not path.is_file():
                raise UserError(f"task file {task} does not exist; pass an lm-eval task name or a task YAML file")
            spec = yaml.safe_load(path.read_text()) or {}
            if not isinstance(spec, dict) or "task" not in spec:
                raise UserError(f"{task} has no `task:` name; it is not an lm-eval task YAML")
            names.append(str(spec["task"]))
            include.append(str(path.parent.resolve()))
        else:
            names.append(task)
    return names, include


@functools.lru_cache(maxsize=8)
def task_manager(include: tuple[str, ...], with_bundled: bool):
    """lm-eval's task index. Indexing the ~15k task files bundled with lm-eval took ~12 s on 2 cores
    (bench/eval_task_index.py), so it is built once per process (a run that evaluates every N steps pays it once)
    and not at all when every task is a file of our own."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include) or None, include_defaults=with_bundled, verbosity="ERROR")


def _task_index(tasks: list[str], work_dir: Path, pydoc_records=None):
    """(lm-eval task names, the task index that knows them), or one line naming the task it does not know."""
    names, include = resolve_tasks(tasks, work_dir, pydoc_records)
    # a task file of the user's own may build on the bundled ones; builtin:pydoc-mc never does
    manager = task_manager(tuple(include), with_bundled=any(task != PYDOC_MC for task in tasks))
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise UserError(
            f"lm-eval knows no task {unknown[0]!r}; pass one of its task names (e.g. hellaswag), a task "
            f"YAML file, or {PYDOC_MC}"
        )
    return names, manager


def _data_error(err: Exception, tasks: list[str]) -> UserError | None:
    """The one line for a task whose data cannot be had: the hub unreachable (datasets raises ConnectionError,
    "Couldn't reach ... (OfflineModeIsEnabled)"); None for any other error, which keeps its own message."""
    if isinstance(err, ConnectionError) or "offlinemodeisenabled" in str(err).lower():
        return UserError(
            f"task(s) {', '.join(tasks)} need data from the Hugging Face hub and it cannot be reached (offline); "
            f"run once online to cache it, or pass a local task YAML or {PYDOC_MC}"
        )
    return None


def check_tasks(tasks: list[str], pydoc_records=None) -> None:
    """Before any training or model load: every task is one lm-eval knows and its data loads (a hub dataset is
    fetched into the datasets cache now, where the evaluation will find it). Costs the task index (~10 s with the
    bundled tasks, kept for the evaluation) instead of a run's worth of training when a name or its data is wrong."""
    with tempfile.TemporaryDirectory() as work, _quiet_progress():
        names, manager = _task_index(tasks, Path(work), pydoc_records)
        try:
            manager.load(names)
        except Exception as err:
            known = _data_error(err, tasks)
            if known is not None:
                raise known from None
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise UserError(
                f"task(s) {', '.join(tasks)} cannot load their data ({type(err).__name__}: {first}); fix the task "
                "or leave it out"
            ) from None


def evaluate_tasks(
    model,
    tokenizer,
    tasks: list[str],
    work_dir: Path,
    limit: Optional[int] = None,
    batch_size: int = 8,
    device: str = "cpu",
    pydoc_records=None,
) -> dict[str, dict[str, float]]:
    """{task: {acc, acc_stderr, acc_norm, acc_norm_stderr, n}} for each task (the metrics it reports)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    names, manager = _task_index(tasks, work_dir, pydoc_records)
    was_training = model.training

    class QuietHFLM(HFLM):  # the harness's per-request bars would flood a training log
        def loglikelihood(self, requests, disable_tqdm=True):
            return super().loglikelihood(requests, disable_tqdm=True)

        def loglikelihood_rolling(self, requests, disable_tqdm=True):
            return super().loglikelihood_rolling(requests, disable_tqdm=True)

        def generate_until(self, requests, disable_tqdm=True):
            return super().generate_until(requests, disable_tqdm=True)

    lm = QuietHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device)
    try:
        with _quiet_progress():
            out = simple_evaluate(
                model=lm,
                tasks=names,
                task_manager=manager,
                limit=limit,
                bootstrap_iters=1000,
                log_samples=False,
                verbosity="ERROR",
            )
    except Exception as err:
        known = _data_error(err, tasks)  # a missing local file or an unknown hub dataset keeps its own message
        if known is not None:
            raise known from None
        raise
    finally:
        model.train(was_training)
    return {task: _scores(out["results"][name]) for task, name in zip(tasks, names)}


def _scores(result: dict) -> dict[str, float]:
    """The harness's "metric,filter" entries by metric name (N/A standard errors as None), and the item count."""
    scores = {}
    for key, value in result.items():
        metric, comma, _ = key.partition(",")
        if comma:
            number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
            scores[metric] = float(number) if number is not None and math.isfinite(number) else None
    scores["n"] = result.get("sample_len")
    return scores


@contextmanager
def _quiet_progress():
    """datasets' bars (its split generation) off while the harness loads a task."""
    import datasets  # here, not at the top: pretraining imports this module and most runs evaluate no task

    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


def score_lines(scores: dict[str, dict[str, float]]) -> list[str]:
    """A Markdown table of every task's acc and acc_norm with their standard errors."""
    lines = ["| task | items | acc | acc_norm |", "|---|---|---|---|"]
    for task, s in scores.items():
        cells = []
        for metric in METRICS:
            value, se = s.get(metric), s.get(f"{metric}_stderr")
            cells.append("-" if value is None else f"{value:.4f}" + (f" ± {se:.4f}" if se is not None else ""))
        lines.append(f"| {task} | {s.get('n')} | {cells[0]} | {cells[1]} |")
    return lines
