"""Muon's extra time per training step (the Newton-Schulz orthogonalisation) against AdamW, side by side.

A GPT-2 of the given shape trains through the trainer's own model, loss and optimizer builders (chunked loss, bf16
autocast where the CPU has bf16 units); AdamW (fused, the default) and Muon (llmlab/train/muon.py) take turns step by
step on the same batches, so background load falls on both alike. Prints the median seconds of a whole step (forward,
backward, optimizer) and of the optimizer step alone, and Muon / AdamW for each:

    python bench/muon_overhead.py --output docs/findings/muon/overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-tiny", help="GPT-2 preset (gpt2-tiny: the quick start's)")
    parser.add_argument("--n_layer", type=int, default=None, help="override the preset's layers")
    parser.add_argument("--n_embd", type=int, default=None, help="override the preset's width (heads of 64)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (the quick start's 8)")
    parser.add_argument("--block", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per optimizer (after 3 untimed)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    return parser.parse_args(argv)


def setups(args):
    """(name, model, optimizer) for AdamW and Muon: the same initial weights, built as train_pretrain.py builds."""
    import torch

    from llmlab.core.config import parse_config
    from llmlab.data.tokenizer import load_tokenizer
    from llmlab.train.loss import CausalLMWithLoss
    from llmlab.train.pretrain import setup
    from llmlab.train.pretrain.config import PretrainConfig

    tokenizer, out = load_tokenizer(), []
    shape = [f"--{k} {v}" for k, v in (("n_layer", args.n_layer), ("n_embd", args.n_embd)) if v is not None]
    if args.n_embd:
        shape.append(f"--n_head {args.n_embd // 64}")
    for name in ("adamw", "muon"):
        argv = ["--model", args.model, "--optimizer", name, *" ".join(shape).split()]
        cfg = parse_config(PretrainConfig, argv)
        torch.manual_seed(0)
        model = CausalLMWithLoss(setup.build_pretrain_model(cfg, tokenizer), 0.0, cfg.loss_chunk_tokens)
        out.append((name, model, setup.build_optimizer(cfg, model)))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from llmlab.core.device import cpu_has_fast_bf16
    from llmlab.core.notices import quiet_known_notices
    from llmlab.core.runinfo import machine_label

    quiet_known_notices()
    torch.set_num_threads(args.threads)
    runs = setups(args)
    bf16 = cpu_has_fast_bf16()
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 50257, (args.batch, args.block), generator=generator) for _ in range(args.steps + 3)]
    times = {name: {"step": [], "optimizer": []} for name, _, _ in runs}
    for k, ids in enumerate(batches):
        for name, model, optimizer in runs:  # interleaved, step by step
            started = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = model(ids)
            loss.backward()
            stepping = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done = time.perf_counter()
            if k >= 3:
                times[name]["step"].append(done - started)
                times[name]["optimizer"].append(done - stepping)
    medians = {name: {part: statistics.median(v) for part, v in parts.items()} for name, parts in times.items()}
    params = sum(p.numel() for p in runs[0][1].parameters())
    print(f"{args.model} ({params / 1e6:.1f}M), batch {args.batch} x {args.block}, {args.steps} steps, bf16 {bf16}")
    print(f"{'':<8}{'step s (median)':>18}{'optimizer s':>14}")
    for name, row in medians.items():
        print(f"{name:<8}{row['step']:>18.4f}{row['optimizer']:>14.4f}")
    ratios = {part: medians["muon"][part] / medians["adamw"][part] for part in ("step", "optimizer")}
    print(f"Muon / AdamW: whole step {ratios['step']:.3f}x, optimizer step {ratios['optimizer']:.2f}x")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        result = {"args": {**vars(args), "output": None}, "machine": machine_label(), "bf16": bf16, "params": params}
        args.output.write_text(json.dumps({**result, "medians": medians, "ratios": ratios}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
