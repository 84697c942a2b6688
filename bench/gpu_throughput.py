#!/usr/bin/env python
"""GPT-2 training throughput and MFU on one device: llmlab vs nanoGPT's recipe vs transformers' Trainer, side by side.

- llmlab: `python train_pretrain.py` as a user runs it (bf16 autocast, SDPA attention, fused AdamW, TF32, pinned
  batches; `--compile` on a GPU), logging every --skip steps as it would every 10.
- nanoGPT's recipe: a plain PyTorch GPT-2 (SDPA attention, tied head), torch.compile on a GPU, fused AdamW, bf16
  autocast, the same batches; the baseline every ratio is against.
- transformers' Trainer with bf16 and SDPA attention (bench/pretrain_throughput.py's run, same data and settings),
  logging every --skip steps too.

Each runs in a fresh process; tokens/s is taken from the end of step --skip to the last step (start-up and
compilation left out), the device synchronised at both ends and nowhere else. MFU = tokens/s x FLOPs per token
(llmlab.models.flops: 6N + attention) / the device's dense bf16 peak (the table printed first; a CPU's is
measured). One table, ratios against nanoGPT's recipe.

`--ablate` then runs llmlab again with one piece of its fast path changed at a time (bf16 autocast, SDPA, fused
AdamW, torch.compile, TF32, pinned batches, and logging (a host sync) every step), each against llmlab as above; the
compile row also prices the compile: its one-off seconds and the steps it takes to earn them back.

    python bench/gpu_throughput.py                       # GPT-2 124M at block 1024 on a GPU, about 5 minutes
    python bench/gpu_throughput.py --model gpt2-tiny --block_size 64 --batch_size 2 --steps 6 --skip 2   # CPU check
    python bench/gpu_throughput.py --ablate all          # and each piece of the fast path, one at a time
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmlab.core.io import atomic_write_text  # noqa: E402
from llmlab.core.runinfo import machine_label  # noqa: E402
from llmlab.models.flops import PEAK_TFLOPS, current_device_name, flops_per_token, peak_flops  # noqa: E402

TRAINERS = ("nanogpt", "llmlab", "trainer")
# llmlab with one piece of its fast path changed: (what changes, its options after llmlab's own)
ABLATIONS = {
    "fp32": ("no bf16 autocast (fp32)", ["--mixed_precision", "no"]),
    "eager-attention": ("eager attention instead of SDPA", ["--attn_implementation", "eager"]),
    "foreach-adamw": ("AdamW foreach, not fused (its finite guard a host read)", ["--optimizer", "adamw-foreach"]),
    "compile": ("torch.compile flipped (off on a GPU, on on a CPU)", None),
    "no-tf32": ("no TF32 for float32 matmuls", ["--no-tf32"]),
    "no-pin-memory": ("pageable batches, blocking copies", ["--no-pin_memory"]),
    "log-every-step": ("log every step: a host sync per step", ["--log_every", "1"]),
}


def throughput_bench():
    spec = importlib.util.spec_from_file_location("pretrain_throughput", REPO / "bench" / "pretrain_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nanogpt_model(n_layer: int, n_embd: int, n_head: int, block_size: int, vocab: int = 50257):
    """nanoGPT's GPT-2: pre-LN blocks, SDPA causal attention, GELU MLP, tied token embedding and head, no dropout."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
            self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
            self.mlp = nn.Sequential(
                nn.Linear(n_embd, 4 * n_embd), nn.GELU(approximate="tanh"), nn.Linear(4 * n_embd, n_embd)
            )

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(n_embd, dim=2)
            q, k, v = (z.view(b, t, n_head, c // n_head).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(b, t, c)
            x = x + self.c_proj(y)
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
            self.blocks, self.ln_f = nn.ModuleList(Block() for _ in range(n_layer)), nn.LayerNorm(n_embd)
            self.head = nn.Linear(n_embd, vocab, bias=False)
            self.head.weight = self.wte.weight
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=0.02)

        def forward(self, ids):
            x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), ids[:, 1:].reshape(-1))

    return GPT()


def run_nanogpt(args, bench) -> dict:
    import numpy as np
    import torch

    from llmlab.core.config import parse_config
    from llmlab.data.prepare import prepare_dataset
    from llmlab.data.tokenizer import load_tokenizer
    from llmlab.models.gpt2 import GPT2_PRESETS
    from llmlab.train.pretrain.config import PretrainConfig

    cfg = parse_config(PretrainConfig, [*bench.common_options(args, 0), "--output_dir", "/tmp/unused"])
    data = prepare_dataset(cfg.data_config(), load_tokenizer())
    preset = GPT2_PRESETS[args.model]
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    model = nanogpt_model(preset["n_layer"], preset["n_embd"], preset["n_head"], args.block_size).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=cfg.learning_rate,
        betas=(0.9, 0.95),
        fused=cuda,
    )
    step_fn = torch.compile(model) if cuda else model
    rows = torch.as_tensor(np.asarray(data.train.with_format("numpy")["input_ids"]).astype(np.int64))
    times = {}
    for step in range(1, args.steps + 1):
        start = (step - 1) * args.batch_size % max(1, len(rows) - args.batch_size)
        ids = rows[start : start + args.batch_size].to(device, non_blocking=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = step_fn(ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step in (args.skip, args.steps):  # as nanoGPT: the host waits for the device only where it reads
            if cuda:
                torch.cuda.synchronize()
            times[step] = time.time()
    return {
        "tokens_per_sec": bench.tokens_per_sec(times, args.skip, args.batch_size * args.block_size),
        "loss": float(loss),
    }


def worker(args) -> dict:
    """One trainer, in this (fresh) process."""
    bench = throughput_bench()
    if args.worker == "nanogpt":
        return run_nanogpt(args, bench)
    if args.worker == "trainer":
        return bench.run_hf_trainer(args, 0, bf16=True)
    if args.variant == "compile":
        args.ours = args.ours + ["--no-compile" if _cuda() else "--compile"]
    elif args.variant:  # on a GPU eager, as the reference it is read against: a compile per row would not fit
        args.ours = args.ours + ABLATIONS[args.variant][1] + (["--no-compile"] if _cuda() else [])
    return bench.run_ours(args, 0)


def flops_per_token_of(args) -> float:
    from llmlab.models.gpt2 import build_gpt2_model

    return flops_per_token(build_gpt2_model(args.model), args.block_size)


def peak_table() -> list[str]:
    lines = ["| device | dense bf16 peak, TFLOP/s |", "|---|---|"]
    return lines + [f"| {name} | {peaks.get('bf16', '-')} |" for name, peaks in PEAK_TFLOPS.items()]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2", help="GPT-2 preset (gpt2 = 124M)")
    parser.add_argument("--block_size", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--batch_size", type=int, default=16, help="sequences per step (no accumulation)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per trainer")
    parser.add_argument("--skip", type=int, default=10, help="steps left out of the timing (start-up, compilation)")
    parser.add_argument("--max_documents", type=int, default=0, help="documents of the corpus (0 = all)")
    parser.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=TRAINERS, help="which to run")
    parser.add_argument(
        "--ablate",
        nargs="+",
        default=[],
        choices=[*ABLATIONS, "all"],
        help="also run llmlab with each of these pieces of its fast path changed (all = every one)",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds of every run; rows give medians, ratios their paired range"
    )
    parser.add_argument("--output", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--worker", choices=TRAINERS, help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=ABLATIONS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or not 0 < args.skip < args.steps:
        parser.error(f"--repeats must be >= 1 and --skip in [1, --steps), got {args.repeats} and {args.skip}")
    args.log_every = args.skip  # llmlab and the Trainer log (a host read) at the timed steps only, as nanoGPT's recipe
    args.ours = ["--mixed_precision", "bf16", "--log_every", str(args.log_every)] + (["--compile"] if _cuda() else [])
    args.ablate = list(ABLATIONS) if "all" in args.ablate else args.ablate
    if args.ablate and _cuda():  # the compile row is the other rows' eager reference there: first, so it is in
        args.ablate = ["compile", *(key for key in args.ablate if key != "compile")]
    if args.max_documents == 0:
        args.max_documents = 10**9
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    device = current_device_name() or "cpu"
    peak = peak_flops(device if _cuda() else None, "bf16")
    per_token = flops_per_token_of(args)
    own = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--ablate", "all", *ABLATIONS)]
    rounds = []
    for _ in range(args.repeats):  # whole rounds, so the machine's drift touches every row alike
        rows = {name: run_worker([*own, "--worker", name]) for name in args.trainers}
        variants = {key: run_worker([*own, "--worker", "llmlab", "--variant", key]) for key in args.ablate}
        rounds.append({**rows, **{f"variant:{key}": row for key, row in variants.items()}})
    merged = {name: merge_rounds([r[name] for r in rounds]) for name in rounds[0]}
    rows = {name: merged[name] for name in args.trainers}
    variants = {key: merged[f"variant:{key}"] for key in args.ablate}
    print_tables(args, rows, variants, device, peak, per_token)
    if args.output:
        result = {"device": device, "cpu": machine_label(), "peak_flops": peak, "flops_per_token": per_token}
        result["args"] = {k: v for k, v in vars(args).items() if k != "output"}
        atomic_write_text(
            args.output, json.dumps({**result, "rows": rows, "ablations": variants}, indent=1, default=str)
        )
    return 0 if all(math.isfinite(r["tokens_per_sec"]) for r in [*rows.values(), *variants.values()]) else 1


def print_tables(args, rows: dict, variants: dict, device: str, peak, per_token: float) -> None:
    print("\n".join(peak_table()) + "\n")
    print(
        f"{args.model} at block {args.block_size}, batch {args.batch_size}, {args.steps} steps (first {args.skip} "
        f"untimed) on {device}; FLOPs per token {per_token:.3g}; peak {peak / 1e12 if peak else float('nan'):.1f} "
        "TFLOP/s bf16"
    )
    base = rows.get("nanogpt", {}).get("tokens_per_sec")
    base = base if base and math.isfinite(base) else None
    print("| trainer | tokens/s | vs nanoGPT's recipe | MFU | last loss |\n|---|---|---|---|---|")
    for name, row in rows.items():
        if "failed" in row:
            print(f"| {name} | failed: {row['failed']} | - | - | - |")
            continue
        ratio = paired_ratio(row, rows["nanogpt"]) if base else "-"
        mfu = f"{row['tokens_per_sec'] * per_token / peak:.1%}" if peak else "-"
        print(f"| {name} | {row['tokens_per_sec']:,.0f} | {ratio} | {mfu} | {row['loss']:.3f} |")
    if variants:
        print(ablation_table(variants, rows.get("llmlab"), args))


def run_worker(worker_args: list[str]) -> dict:
    """One trainer in a fresh process; a failure is a row saying why (on a lent GPU, one table with a failed row
    beats none), and the row carries the process's wall time (start-up, data, compile and steps)."""
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, *worker_args], capture_output=True, text=True, cwd=REPO, env={**os.environ}
    )
    name = " ".join(worker_args[worker_args.index("--worker") + 1 :]).replace("--variant ", "")
    if proc.returncode != 0:
        print(f"{name} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"tokens_per_sec": float("nan"), "loss": float("nan"), "failed": last[:200]}
    row = {**json.loads(proc.stdout.strip().splitlines()[-1]), "wall_s": time.perf_counter() - started}
    # each row as it ends: a GPU call cut short by its time limit keeps what it measured
    print(f"{name}: {row['tokens_per_sec']:,.0f} tokens/s, {row['wall_s']:.0f} s in all", flush=True)
    return row


def merge_rounds(runs: list[dict]) -> dict:
    """One row from its rounds: median tokens/s, wall time and loss, each round's tokens/s kept for the ratios."""
    failed = [run for run in runs if "failed" in run]
    if failed:
        return failed[0]
    merged = {key: statistics.median(run[key] for run in runs) for key in ("tokens_per_sec", "loss", "wall_s")}
    return {**merged, "rounds": [run["tokens_per_sec"] for run in runs]}


def rounds_of(row: dict) -> list[float]:
    """A row's tokens/s round by round (a single run's row is its one round)."""
    return row.get("rounds", [row["tokens_per_sec"]])


def paired_ratio(row: dict, base: dict) -> str:
    """row / base, round by round: the median, and with several rounds their range."""
    ratios = [a / b for a, b in zip(rounds_of(row), rounds_of(base))]
    text = f"{statistics.median(ratios):.2f}x"
    return text if len(ratios) == 1 else f"{text} ({min(ratios):.2f}-{max(ratios):.2f})"


def ablation_table(variants: dict, default: dict | None, args) -> str:
    """llmlab with one piece changed, each against llmlab as it runs by default (the main table's row). On a GPU
    the other rows run eager, so they are read against the compile row (llmlab eager), and each row is one minute
    less of compiling."""
    tokens_per_step = args.batch_size * args.block_size
    reference = variants.get("compile") if _cuda() else default
    lines = [
        "",
        f"| llmlab, one piece changed{' (eager but the compile row)' if _cuda() else ''} | tokens/s | vs llmlab"
        f"{' eager' if _cuda() else ''} | note |",
        "|---|---|---|---|",
    ]
    for key, row in variants.items():
        label, base = ABLATIONS[key][0], default if key == "compile" else reference
        if "failed" in row or base is None or "failed" in base:
            lines.append(f"| {label} | {row.get('failed', 'its reference failed')} | - | - |")
            continue
        note = ""
        if key == "compile":  # price the compile: one-off seconds, and the steps that earn them back
            compiled, eager = (base, row) if _cuda() else (row, base)
            step_c, step_e = (tokens_per_step / r["tokens_per_sec"] for r in (compiled, eager))
            cost = (compiled["wall_s"] - args.steps * step_c) - (eager["wall_s"] - args.steps * step_e)
            faster = all(c > e for c, e in zip(rounds_of(compiled), rounds_of(eager)))
            note = f"compile costs {cost:.0f} s; " + (  # a gain only where every round saw one
                f"earned back after {cost / (step_e - step_c):,.0f} steps" if faster else "no per-step gain resolved"
            )
        lines.append(f"| {label} | {row['tokens_per_sec']:,.0f} | {paired_ratio(row, base)} | {note} |")
    return "\n".join(lines)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    raise SystemExit(main())
