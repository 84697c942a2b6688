"""The coordinate check of muP for GPT-2 (Tensor Programs V; the `mup` package's coord_check), through the trainer's
own model and optimizer builders (llmlab/train/coord_check.py).

For each parametrization, width and seed: a fresh GPT-2 of `--depth` layers (heads of 64), AdamW at `--lr` on the
first blocks of the built-in Wikipedia sample, and in each of the first `--steps` forwards the RMS of every block's
attention output, MLP output and residual stream (averaged over blocks), and of the logits. Prints the slope of
ln RMS on ln width per step, and writes the rows, the slopes, a plot and the machine:

    python bench/coord_check.py --output docs/findings/coord-check
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512, 1024], help="n_embd values")
    parser.add_argument("--depth", type=int, default=4, help="GPT-2 layers")
    parser.add_argument("--steps", type=int, default=8, help="AdamW steps recorded (step 1: the initial model)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per width (RMS averaged over them)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW lr (the lab's GPT-2 probes' optimum region)")
    parser.add_argument("--base_width", type=int, default=128, help="muP base width (the lab's GPT-2 probes')")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--output", type=Path, default=None, help="folder for the CSVs, the plot and the machine")
    return parser.parse_args(argv)


def slope_table(slopes: list[dict], steps: list[int]) -> str:
    coordinates = ("attn", "mlp", "residual", "logits")
    lines = [
        "| parametrization | step | " + " | ".join(coordinates) + " |",
        "|---|---|" + "---|" * len(coordinates),
    ]
    by_key = {(s["parametrization"], s["step"], s["what"]): s["slope"] for s in slopes}
    for parametrization in ("standard", "mup"):
        for step in steps:
            cells = " | ".join(f"{by_key[parametrization, step, what]:+.2f}" for what in coordinates)
            lines.append(f"| {parametrization} | {step} | {cells} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    coordinates = ("attn", "mlp", "residual", "logits")
    steps = sorted({r["step"] for r in rows})
    fig, axes = plt.subplots(2, 4, figsize=(16, 7), sharex=True)
    colours = plt.cm.viridis(np.linspace(0, 0.9, len(steps)))
    for i, parametrization in enumerate(("standard", "mup")):
        for j, what in enumerate(coordinates):
            ax = axes[i, j]
            for step, colour in zip(steps, colours):
                picked = [
                    r for r in rows if (r["parametrization"], r["what"], r["step"]) == (parametrization, what, step)
                ]
                widths = sorted({r["width"] for r in picked})
                means = [np.mean([r["rms"] for r in picked if r["width"] == w]) for w in widths]
                ax.plot(widths, means, marker="o", color=colour, label=f"step {step}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{parametrization}: {what}")
            if i == 1:
                ax.set_xlabel("width (n_embd)")
            if j == 0:
                ax.set_ylabel("RMS of the output")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("Coordinate check, GPT-2 (heads of 64), AdamW: RMS in width over the first steps")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from llmlab.core.notices import quiet_known_notices
    from llmlab.core.runinfo import machine_label, package_versions
    from llmlab.train.coord_check import CoordCheck, run_coord_check, slopes

    quiet_known_notices()
    torch.set_num_threads(args.threads)
    cfg = CoordCheck(
        widths=tuple(args.widths),
        depth=args.depth,
        steps=args.steps,
        batch=args.batch,
        seq=args.seq,
        lr=args.lr,
        base_width=args.base_width,
        seeds=tuple(range(args.seeds)),
    )
    rows = run_coord_check(cfg)
    fitted = slopes(rows)
    print(slope_table(fitted, list(range(1, args.steps + 1))))
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        for name, table in (("coord_check.csv", rows), ("slopes.csv", fitted)):
            with open(args.output / name, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(table[0]))
                writer.writeheader()
                writer.writerows(table)
        plot(rows, args.output / "coord_check.png")
        machine = {"cpu": machine_label(), "versions": package_versions(), "args": {**vars(args), "output": None}}
        (args.output / "run_info.json").write_text(json.dumps(machine, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
