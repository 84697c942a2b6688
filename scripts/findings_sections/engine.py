"""The training step: host syncs, the CPU fast path, and the coordinate check."""

from __future__ import annotations

import csv
import json

from findings_sections.common import FINDINGS, _paired


def host_syncs() -> str:
    """bench/host_syncs.py before and after the step stopped reading back: each run's last line is its JSON."""
    runs = {
        when: json.loads((FINDINGS / "fast-path" / f"host_syncs_{when}.txt").read_text().strip().splitlines()[-1])
        for when in ("before", "after")
    }
    before, after = runs["before"], runs["after"]
    lines = ["| per optimizer step (2 micro-batches) | before | after |", "|---|---|---|"]
    for name, label in (
        ("trial, clip norm", "a sweep trial, norm clipping"),
        ("trial, clip value", "a sweep trial, value clipping"),
        ("trial, clip norm, measured step", "a sweep trial, a measured step (per-layer ratio probes)"),
    ):
        lines.append(f"| {label} | {before[name]['total']:.0f} | {after[name]['total']:.0f} |")
    old, new = before["train_pretrain.py"], after["train_pretrain.py"]
    lines.append(
        f"| train_pretrain.py, a step that does not log | {old['other steps']:.0f} | {new['other steps']:.0f} |"
    )
    lines.append(
        f"| train_pretrain.py, a log step (every 5th here) | {old['log steps']:.0f} | {new['log steps']:.0f} |"
    )
    return "\n".join(lines)


def coord_check() -> str:
    """bench/coord_check.py: the slope of ln RMS on ln width per parametrization, coordinate and step."""
    folder = FINDINGS / "coord-check"
    with open(folder / "slopes.csv", newline="") as f:
        slopes = {(r["parametrization"], int(r["step"]), r["what"]): float(r["slope"]) for r in csv.DictReader(f)}
    machine = json.loads((folder / "run_info.json").read_text())
    args = machine["args"]
    steps = sorted({step for _, step, _ in slopes})
    shown = [steps[0], steps[1], steps[len(steps) // 2], steps[-1]]
    coordinates = ("attn", "mlp", "residual", "logits")
    lines = [
        "| parametrization | step | " + " | ".join(coordinates) + " |",
        "|---|---|" + "---|" * len(coordinates),
    ]
    for parametrization in ("standard", "mup"):
        for step in shown:
            cells = " | ".join(f"{slopes[parametrization, step, what]:+.2f}" for what in coordinates)
            lines.append(f"| {'muP' if parametrization == 'mup' else parametrization} | {step} | {cells} |")
    widths = ", ".join(str(w) for w in args["widths"])
    hidden = ("attn", "mlp", "residual")
    sp = [slopes["standard", step, what] for step in steps[2:] for what in hidden]
    sp_logits = [slopes["standard", step, "logits"] for step in steps[2:]]
    mup = max(abs(slopes["mup", step, what]) for step in steps for what in hidden)
    lines.append(
        f"\nFrom step 3 on, the standard parametrization's hidden slopes span {min(sp):+.2f} to {max(sp):+.2f} and its "
        f"logits' {min(sp_logits):+.2f} to {max(sp_logits):+.2f}; muP's hidden slopes stay within ±{mup:.2f} at every "
        f"step, and its logits' rise from {slopes['mup', steps[0], 'logits']:+.2f} to "
        f"{slopes['mup', steps[-1], 'logits']:+.2f}."
    )
    return "\n".join(lines) + (
        f"\n\nSlope of ln RMS on ln width (widths {widths}; RMS averaged over {args['seeds']} seeds and over the "
        f"blocks), GPT-2 of {args['depth']} layers with heads of 64, AdamW lr {args['lr']:g}, {args['batch']} x "
        f"{args['seq']} tokens of builtin:wiki a step, muP base width {args['base_width']}; step 1 is the initial "
        f"model; on {machine['cpu']}."
    )


def fast_path_cpu() -> str:
    """bench/gpu_throughput.py --ablate all on this CPU: the three trainers, then llmlab with one piece changed."""
    data = json.loads((FINDINGS / "fast-path" / "cpu_throughput.json").read_text())
    rows, args = data["rows"], data["args"]
    lines = ["| trainer | tokens/s (median) | vs nanoGPT's recipe (range) |", "|---|---|---|"]
    lines += [
        f"| {name} | {row['tokens_per_sec']:,.0f} | {_paired(row, rows['nanogpt'])} |" for name, row in rows.items()
    ]
    lines += ["", "| llmlab, one piece changed | tokens/s (median) | vs llmlab (range) |", "|---|---|---|"]
    labels = {
        "fp32": "fp32 instead of bf16 autocast",
        "eager-attention": "eager attention instead of SDPA",
        "foreach-adamw": "AdamW foreach instead of fused",
        "compile": "torch.compile on (off by default on a CPU)",
        "no-tf32": "TF32 off (GPU only: no effect here)",
        "no-pin-memory": "pinned memory off (GPU only: no effect here)",
        "log-every-step": "a log step (a host read) every step",
    }
    for key, row in data["ablations"].items():
        lines.append(f"| {labels[key]} | {row['tokens_per_sec']:,.0f} | {_paired(row, rows['llmlab'])} |")
    return "\n".join(lines) + (
        f"\n\n{args['model']}, batch {args['batch_size']} x {args['block_size']} tokens, {args['steps']} steps "
        f"(first {args['skip']} untimed), each run in a fresh process; {args['repeats']} rounds of every run back to "
        f"back, ratios paired within a round; on {data['cpu']}."
    )
