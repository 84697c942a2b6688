"""One analysis of an lr x batch-size sweep: the single-size fits (fits.py) and, with several model sizes, the law
across sizes and its held-out verdict (transfer.py). Kept apart from both so neither imports the other."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import numpy as np

from llmlab.scaling.fits import (
    ScalingOptions,
    feasible_region,
    loss_std_fit,
    lr_batch_fit,
    lr_optimum,
    memory_fit,
    number,
    unavailable,
)
from llmlab.scaling.transfer import analyse_sizes


def analyse(rows: list[dict], options: ScalingOptions) -> dict:
    """Feasible region, best lr per batch size and the three fits, as one JSON-ready dict; with several model sizes
    also the joint fit across sizes and its held-out check (llmlab.scaling.transfer). Per-batch fits, memory and
    the model the plan is for are then those of the largest size."""
    rows = [{**row, "trial_id": row.get("trial_id") or f"row{i}"} for i, row in enumerate(rows)]
    feasible, dropped, thresholds = feasible_region(rows, options)
    transfer, sized_rows, sized_feasible = None, rows, feasible
    if len({str(r.get("size")) for r in rows if r.get("size") not in (None, "")}) >= 2:
        # the scan's own rule (llmlab.scaling.scan): every finished, finite run below the uniform guess is a measurement
        transfer = analyse_sizes(
            feasible_region(rows, replace(options, unstable_std=math.inf))[0],
            options.confidence,
            options.holdout,
            options.preregistration,
            options.machine_order,
        )
        largest = transfer["sizes"][-1] if transfer["sizes"] else None
        sized_rows = [r for r in rows if str(r.get("size")) == largest]
        sized_feasible = [r for r in feasible if str(r.get("size")) == largest]
    by_batch: dict[float, list[dict]] = {}
    for row in sized_feasible:
        by_batch.setdefault(float(row["batch_size"]), []).append(row)
    lr_points = [{"batch_size": batch, **lr_optimum(trials)} for batch, trials in sorted(by_batch.items())]
    fits: dict[str, dict] = {}
    for name, make in (
        ("lr_opt", lambda: lr_batch_fit(lr_points, options)),
        ("peak_memory_mb", lambda: memory_fit(sized_rows, options)),
        ("loss_std", lambda: loss_std_fit(sized_feasible, options)),
    ):
        try:
            fits[name] = make()
        except (ValueError, np.linalg.LinAlgError) as err:  # degenerate data must not sink the sweep's report
            fits[name] = unavailable(f"fit failed on these data ({err})")
    return {
        "options": {**vars(options)},
        "thresholds": thresholds,
        "n_trials": len(rows),
        "n_feasible": len(feasible),
        "feasible_ids": [r.get("trial_id") for r in feasible],
        "dropped": dropped,
        "lr_opt_per_batch": lr_points,
        "fits": fits,
        "measured": _measured(sized_rows),
        "transfer": transfer,
        "trials": rows,
    }


def _measured(rows: list[dict]) -> dict:
    models = sorted({str(r.get("model")) for r in rows if r.get("model") is not None})
    seq_len = next(filter(None, (_sequence_length(r) for r in rows)), None)
    # a scan across lengths carries its D as n_params and the model's N as n_params_model
    params = next(
        filter(None, (number(r.get("n_params_model") or r.get("n_params") or r.get("params")) for r in rows)), None
    )
    if params is None and len(models) == 1:
        params = swept_model_parameters(models[0], int(seq_len or 1024))
    return {
        "models": models,
        "params": params,
        "seq_len": seq_len,
        "size": next((str(r["size"]) for r in rows if r.get("size")), None),
    }


def _sequence_length(row: dict) -> Optional[float]:
    """The trial's tokens per sequence: recorded directly, or train_tokens / (steps x batch)."""
    direct = number(row.get("seq_len") or row.get("block_size"))
    if direct:
        return direct
    tokens, steps, batch = (number(row.get(k)) for k in ("train_tokens", "steps", "batch_size"))
    return round(tokens / (steps * batch)) if tokens and steps and batch else None


def swept_model_parameters(model: str, block_size: int) -> Optional[int]:
    """All parameters (trainable and frozen: both take memory) of the swept model, built on the meta device."""
    try:
        import torch

        with torch.device("meta"):
            if model == "minimal":
                from llmlab.models.minimal import MinimalTransformer, MinimalTransformerConfig

                net = MinimalTransformer(MinimalTransformerConfig(max_seq_len=block_size))
            else:
                from llmlab.models.gpt2 import build_gpt2_model

                net = build_gpt2_model(model, n_positions=block_size)
        return int(sum(p.numel() for p in net.parameters()))
    except Exception:  # an unknown model name: the recommendation then asks for --tokens instead
        return None
