"""The quick start by the quality it reaches in its time: bench/time_to_loss.py's table."""

from __future__ import annotations

import json

from findings_sections.common import FINDINGS, interval, signed

LABELS = {
    "llmlab": "llmlab defaults (`python train_pretrain.py`)",
    "nanogpt": "nanoGPT's recipe",
    "trainer": "transformers' Trainer",
}


def _against(row: dict) -> tuple[str, str, str]:
    """A recipe against the reference, paired by seed: its training time, its loss at equal time, its time to the
    target (a ratio over the seeds where both reached it)."""
    d, r = row["loss_at_minus_reference"], row["time_ratio"]
    delta = f"{signed(d['mean'])} {interval(*d['ci95'])}, {d['df']} df" if d["ci95"] else signed(d["mean"])
    if r is None:
        ratio = "–"
    elif r["pairs"] == 1:
        ratio = f"{r['median']:.2f}x (1 seed)"
    else:
        ratio = f"{r['median']:.2f}x ({r['range'][0]:.2f}–{r['range'][1]:.2f})"
    return f"{row['train_seconds_ratio']:.2f}x", delta, ratio


def time_to_loss() -> str:
    """Medians over seeds; each recipe against llmlab's defaults, paired by seed (the bench's reference)."""
    data = json.loads((FINDINGS / "quickstart" / "time_to_loss.json").read_text())
    target, at, ref = data["target"], data["at_seconds"], data["reference"]
    lines = [
        f"| recipe (190 steps of 8 × 128) | training s | / {ref} | loss at {at:.0f} s | − {ref} [95 % CI] "
        f"| s to {target} | / {ref} | final loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in data["table"].items():
        to = f"{row['seconds_to_target']:.0f}" if row["seconds_to_target"] is not None else f"({row['reached']})"
        length, delta, ratio = ("1", "reference", "1") if name == ref else _against(row)
        label = LABELS.get(name, f"llmlab `{data['recipes'][name]}`")
        lines.append(
            f"| {label} | {row['train_seconds']:.0f} | {length} | {row['loss_at']:.3f} | {delta} | {to} | {ratio} "
            f"| {row['final_loss']:.3f} |"
        )
    lines.append(
        f"\nMedians over {data['seeds']} seeds on {data['machine']}; each seed's recipes ran back to back, so the "
        f"contrasts are paired by seed (t on seeds − 1 df; time ratios: median and range over the seeds where both "
        f"reached {target}, or `(k of n)` seeds reached it). Seconds are training seconds, evaluation excluded; the "
        f"loss is the mean over the same 20 validation batches (unigram line 7.88). "
        f"`python bench/time_to_loss.py --seeds {data['seeds']}`."
    )
    return "\n".join(lines)


def muon_overhead() -> str:
    """bench/muon_overhead.py at the quick start's model and at the lab's 128x12 probe: Muon's step over AdamW's."""
    lines = [
        "| model | parameters | sequences a step | threads | AdamW step | Muon step | Muon / AdamW: step "
        "| optimizer alone |",
        "|---|---|---|---|---|---|---|---|",
    ]
    machines = set()
    for name in ("overhead", "overhead_probe"):
        data = json.loads((FINDINGS / "muon" / f"{name}.json").read_text())
        args, medians, ratios = data["args"], data["medians"], data["ratios"]
        shape = args["model"] if args["n_layer"] is None else f"GPT-2 {args['n_embd']}x{args['n_layer']}"
        lines.append(
            f"| {shape} | {data['params'] / 1e6:.1f}M | {args['batch']} × {args['block']} | {args['threads']} | "
            f"{medians['adamw']['step']:.3f} s | {medians['muon']['step']:.3f} s | **{ratios['step']:.2f}x** | "
            f"{ratios['optimizer']:.1f}x |"
        )
        machines.add(data["machine"])
    lines.append(
        f"\nMedians of {args['steps']} steps each, the two optimizers taking turns step by step on the same batches, "
        f"on {' and '.join(sorted(machines))}. `python bench/muon_overhead.py`."
    )
    return "\n".join(lines)
