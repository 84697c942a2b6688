#!/usr/bin/env python
"""GPT-2 training throughput and MFU on one device: llmlab vs nanoGPT's recipe vs transformers' Trainer, side by side.

- llmlab: `python train_pretrain.py` as a user runs it (bf16 where the device has it; `--compile` on a GPU).
- nanoGPT's recipe: a plain PyTorch GPT-2 (SDPA attention, tied head), torch.compile on a GPU, fused AdamW, bf16
  autocast, the same batches; the baseline every ratio is against.
- transformers' Trainer with bf16 and SDPA attention (bench/pretrain_throughput.py's run, same data and settings).

Each runs in a fresh process; tokens/s is taken from the end of step --skip to the last step (start-up and
compilation left out). MFU = tokens/s x FLOPs per token (llmlab.models.flops: 6N + attention) / the device's dense
bf16 peak (the table printed first; a CPU's is measured). One table, ratios against nanoGPT's recipe.

    python bench/gpu_throughput.py                       # GPT-2 124M at block 1024 on a GPU, about 5 minutes
    python bench/gpu_throughput.py --model gpt2-tiny --block_size 64 --batch_size 2 --steps 6 --skip 2   # CPU check
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmlab.core.io import atomic_write_text  # noqa: E402
from llmlab.models.flops import PEAK_TFLOPS, current_device_name, flops_per_token, peak_flops  # noqa: E402

TRAINERS = ("nanogpt", "llmlab", "trainer")


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
    return bench.run_ours(args, 0)


def flops_per_token_of(args) -> float:
    from llmlab.models.gpt2 import build_gpt2_model

    return flops_per_token(build_gpt2_model(args.model), args.block_size)


def peak_table() -> list[str]:
    lines = ["| device | dense bf16 peak, TFLOP/s |", "|---|---|"]
    return lines + [f"| {name} | {peaks.get('bf16', '-')} |" for name, peaks in PEAK_TFLOPS.items()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2", help="GPT-2 preset (gpt2 = 124M)")
    parser.add_argument("--block_size", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--batch_size", type=int, default=16, help="sequences per step (no accumulation)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per trainer")
    parser.add_argument("--skip", type=int, default=10, help="steps left out of the timing (start-up, compilation)")
    parser.add_argument("--max_documents", type=int, default=0, help="documents of the corpus (0 = all)")
    parser.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=TRAINERS, help="which to run")
    parser.add_argument("--output", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--worker", choices=TRAINERS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.ours = ["--mixed_precision", "bf16", "--log_every", "1"] + (["--compile"] if _cuda() else [])
    if args.max_documents == 0:
        args.max_documents = 10**9
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    device = current_device_name() or "cpu"
    peak = peak_flops(device if _cuda() else None, "bf16")
    per_token = flops_per_token_of(args)
    rows = {}
    for name in args.trainers:
        command = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--worker", name]
        proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env={**os.environ})
        if proc.returncode != 0:  # the others still run: on a lent GPU one table with a failed row beats none
            print(f"{name} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            rows[name] = {"tokens_per_sec": float("nan"), "loss": float("nan"), "failed": last[:200]}
            continue
        rows[name] = json.loads(proc.stdout.strip().splitlines()[-1])
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
        ratio = f"{row['tokens_per_sec'] / base:.2f}x" if base else "-"
        mfu = f"{row['tokens_per_sec'] * per_token / peak:.1%}" if peak else "-"
        print(f"| {name} | {row['tokens_per_sec']:,.0f} | {ratio} | {mfu} | {row['loss']:.3f} |")
    if args.output:
        atomic_write_text(
            args.output,
            json.dumps(
                {
                    "device": device,
                    "peak_flops": peak,
                    "flops_per_token": per_token,
                    "args": {k: v for k, v in vars(args).items() if k != "output"},
                    "rows": rows,
                },
                indent=1,
                default=str,
            ),
        )
    return 0 if all(math.isfinite(r["tokens_per_sec"]) for r in rows.values()) else 1


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    raise SystemExit(main())
