"""merge_and_infer.py eval: a model folder (merged, or base + adapter) scored on lm-evaluation-harness tasks.

Kept apart from llmlab.infer.downstream, which the trainers import: loading at a precision pulls in peft and the
quantization backends, which a training run never needs.
"""

from __future__ import annotations

from pathlib import Path

from llmlab.core.io import atomic_write_json
from llmlab.infer.downstream import check_tasks, evaluate_tasks, score_lines
from llmlab.infer.loading import load_from_config


def run_eval(cfg, log=print) -> dict:
    """merge_and_infer.py eval: any model folder (merged or base + adapter) scored on --tasks, each task checked
    before the model loads."""
    check_tasks(cfg.tasks)
    loaded = load_from_config(cfg, log)
    scores = evaluate_tasks(
        loaded.model,
        loaded.tokenizer,
        cfg.tasks,
        Path(cfg.work_dir),
        limit=cfg.limit,
        batch_size=cfg.batch_size,
        device=loaded.device,
    )
    source = cfg.model or f"{cfg.base_model} + {cfg.adapter}"
    log("\n".join([f"{source} at {loaded.precision} on {loaded.device}:", *score_lines(scores)]))
    result = {"model": source, "precision": loaded.precision, "tasks": scores}
    if cfg.output:
        atomic_write_json(cfg.output, result)
    return result
