#!/usr/bin/env python
"""Peak memory of one GPT-2 training step: today's path vs the fused GELU and the chunked head.

Three sides, each in its own fresh process (peak RSS is per process): (1) the trainer as it was, GPT-2's
`gelu_new` (six elementwise ops, each keeping a [tokens x 4 width] tensor) and the model's full logits + cross-
entropy; (2) the same with the one-op `gelu_pytorch_tanh` (the same function); (3) that plus the chunked head +
cross-entropy (llmlab.train.loss). Each builds the model (seeded), runs one forward + backward + AdamW step
on the same batch and reports the process's peak RSS, the loss and a checksum of the gradients. Default: gpt2
(124M, no dropout as train_pretrain.py trains it) at batch 8 x 1024 tokens on CPU, fp32. Prints a table with the ratio.

  python bench/loss_memory.py                                  # ~3 minutes on 2 cores, ~14 GB RAM at peak
  python bench/loss_memory.py --model gpt2-tiny --seq 256      # seconds
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


SIDES = [
    ("gelu_new + full logits (before)", "gelu_new", 0),
    ("fused GELU + full logits", "gelu_pytorch_tanh", 0),
    ("fused GELU + chunked head (now)", "gelu_pytorch_tanh", None),
]


def worker(model_name: str, batch: int, seq: int, chunk: int, activation: str) -> dict:
    sys.path.insert(0, str(REPO))
    import torch

    from llmlab.models.gpt2 import build_gpt2_model
    from llmlab.train.loss import CausalLMWithLoss

    torch.manual_seed(0)
    net = build_gpt2_model(model_name, n_positions=max(seq, 128), activation_function=activation)  # dropout 0
    model = CausalLMWithLoss(net, 0.0, chunk)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, 50257, (batch, seq), generator=torch.Generator().manual_seed(1))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tick = time.perf_counter()
    loss = model(ids)
    loss.backward()
    grad_sum = float(sum(p.grad.double().abs().sum() for p in model.parameters()))
    optimizer.step()
    seconds = time.perf_counter() - tick
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "chunk": chunk,
        "loss": float(loss),
        "grad_abs_sum": grad_sum,
        "peak_mb": peak,
        "before_step_mb": before,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per chunk of the chunked side")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--activation", default="gelu_pytorch_tanh", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.model, args.batch, args.seq, args.worker, args.activation)))
        return
    rows = []
    for name, activation, chunk in SIDES:
        cmd = [
            sys.executable,
            __file__,
            "--model",
            args.model,
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
            "--worker",
            str(args.chunk if chunk is None else chunk),
            "--activation",
            activation,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        rows.append({"side": name, **json.loads(out)})
    print(
        f"one training step of {args.model}, batch {args.batch} x {args.seq} tokens, fp32 on CPU, no dropout "
        f"(each side in a fresh process; chunk {args.chunk} tokens)"
    )
    print(f"{'side':<34} {'peak RSS MB':>12} {'ratio':>6} {'step s':>8} {'loss':>10} {'sum |grad|':>14}")
    for row in rows:
        print(
            f"{row['side']:<34} {row['peak_mb']:>12.0f} {row['peak_mb'] / rows[0]['peak_mb']:>6.2f} "
            f"{row['seconds']:>8.1f} {row['loss']:>10.6f} {row['grad_abs_sum']:>14.6g}"
        )
    before, now = rows[0], rows[-1]
    print(
        f"peak memory now / before: {now['peak_mb'] / before['peak_mb']:.2f}x (model + AdamW baseline "
        f"{before['before_step_mb']:.0f} MB before the step); loss difference {abs(now['loss'] - before['loss']):.2e}, "
        f"grad-sum relative difference {abs(now['grad_abs_sum'] / before['grad_abs_sum'] - 1):.2e}"
    )


if __name__ == "__main__":
    main()
