"""What a GPT-2 probe's training step costs at each width, measured the way a scan runs it: the price of a design.

A scan's trial-hours are its trials' steps times their step time. The scan's own trials give that time only at the
sizes it ran, and only under whatever else shared the machine then (a CI run beside a scan's 64x12 trials doubled
their step time). This bench measures every width side by side on a quiet machine: for each width, --concurrent
single-thread processes (a scan's --workers 2 --threads_per_worker 1) each time --steps training steps of the lab's
probe (the trial's own model builder, fused AdamW, bf16 autocast where the CPU has bf16 units, batch 4 x 128
tokens); the median step after --skip warm-up steps, median over the processes. At these widths the vocabulary's
head is a large part of the step, so the table also fits the step time as a line in *total* parameters (embeddings
included), which `bench/forecast_design.py --step_times` uses to price sizes between and beyond those measured.

    python bench/probe_step_time.py --widths 64 192 320 384 576 --output docs/findings/lr-forecast-gpt2/step_times.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 192, 320, 384, 576], help="probe widths")
    parser.add_argument("--depth", type=int, default=12, help="layers (12: GPT-2 124M's depth)")
    parser.add_argument("--parametrization", choices=("standard", "mup"), default="mup", help="the probes'")
    parser.add_argument("--batch_size", type=int, default=4, help="sequences per step")
    parser.add_argument("--block_size", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=14, help="timed steps per process")
    parser.add_argument("--skip", type=int, default=3, help="first steps left out (allocation, warm-up)")
    parser.add_argument("--concurrent", type=int, default=2, help="processes side by side (a scan's --workers)")
    parser.add_argument("--output", type=Path, help="write the table as JSON here")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def worker(args) -> None:
    """One process: the step times of one width, as JSON on stdout."""
    import torch

    from llmlab.core.device import cpu_has_fast_bf16
    from llmlab.models.gpt2 import build_gpt2_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    width = args.worker
    model = build_gpt2_model(
        "gpt2",
        n_embd=width,
        n_layer=args.depth,
        n_head=width // 64,
        n_positions=args.block_size,
        parametrization=args.parametrization,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    tokens = torch.randint(0, 50257, (args.batch_size, args.block_size))
    times = []
    for _ in range(args.skip + args.steps):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cpu_has_fast_bf16()):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    counts = {
        "total": sum(p.numel() for p in model.parameters()),
        "non_embedding": model.num_parameters(exclude_embeddings=True),
    }
    print(json.dumps({"step_s": statistics.median(times[args.skip :]), **counts}))


def measure(args, width: int) -> dict:
    command = [sys.executable, __file__, "--worker", str(width), *sys.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True, env=env) for _ in range(args.concurrent)
    ]
    rows = []
    for proc in procs:
        out, _ = proc.communicate(timeout=1800)
        if proc.returncode:
            raise SystemExit(f"the {width}-wide worker failed (exit {proc.returncode})")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return {**rows[0], "step_s": statistics.median(r["step_s"] for r in rows), "width": width}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    from llmlab.core.io import atomic_write_text
    from llmlab.core.runinfo import machine_label

    rows = [measure(args, width) for width in args.widths]
    slope, intercept = np.polyfit([r["total"] for r in rows], [r["step_s"] for r in rows], 1)
    base = rows[0]["step_s"]
    print(f"| width x {args.depth} | N (non-embedding) | total parameters | step s | x {rows[0]['width']} | line |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        line = intercept + slope * r["total"]
        print(
            f"| {r['width']} | {r['non_embedding']:,} | {r['total']:,} | {r['step_s']:.3f} | "
            f"{r['step_s'] / base:.2f}x | {line:.3f} |"
        )
    label = machine_label()
    per_million = slope * 1e6
    print(f"step s = {intercept:.3f} + {per_million:.4f} per million parameters; {args.concurrent} at once; {label}")
    if args.output:
        result = {"rows": rows, "line": {"intercept": intercept, "slope": slope}, "machine": label, **vars(args)}
        result["output"] = str(args.output)
        atomic_write_text(args.output, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
