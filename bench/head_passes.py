#!/usr/bin/env python
"""The output layer + cross-entropy, forward and backward, three ways side by side on this CPU:

- `full logits`: what transformers' Trainer runs (GPT2LMHeadModel's logits, then F.cross_entropy, autograd);
- `chunked, before`: llmlab's chunked head as it was (two exps per logit, a softmax allocated per chunk);
- `chunked, now`: llmlab.train.loss (one exp per logit, the softmax written over a reused logits buffer).

Same inputs, alternating per repeat; the table gives median milliseconds, the ratio to the full-logits path, and
the largest difference of the loss and gradients from it. The gpt2-tiny shape by default (8 x 256 tokens, width
256, GPT-2's vocabulary), fp32.

    python bench/head_passes.py                  # ~1 minute on 2 cores
    python bench/head_passes.py --tokens 4096 --width 768
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def full_logits(hidden, weight, labels):
    loss = F.cross_entropy(F.linear(hidden, weight).float(), labels)
    loss.backward()
    return loss


def chunked_before(hidden, weight, labels, chunk=1024):
    """The previous fused head, inlined: logsumexp, then softmax as a new tensor, then the scale as another pass."""
    scale = 1.0 / labels.numel()
    grad_hidden, grad_weight, total = torch.empty_like(hidden), torch.zeros_like(weight), 0.0
    with torch.no_grad():
        for start in range(0, hidden.size(0), chunk):
            part = slice(start, start + chunk)
            logits = F.linear(hidden[part], weight).float()
            lse = logits.logsumexp(dim=-1)
            total += float((lse - logits.gather(1, labels[part, None]).squeeze(1)).sum())
            grad = torch.softmax(logits, dim=-1)
            grad[torch.arange(len(grad)), labels[part]] -= 1
            grad *= scale
            grad_hidden[part] = grad @ weight
            grad_weight += grad.t() @ hidden[part]
    hidden.grad, weight.grad = grad_hidden, grad_weight
    return torch.tensor(total * scale)


def chunked_now(hidden, weight, labels):
    from llmlab.train.loss import chunked_lm_loss

    ids = torch.cat([labels[:1], labels])[None]  # chunked_lm_loss shifts its inputs into labels itself
    loss = chunked_lm_loss(hidden[None], weight, ids)
    loss.backward()
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch (default 8 x 256)")
    parser.add_argument("--width", type=int, default=256, help="hidden width (gpt2-tiny: 256)")
    parser.add_argument("--vocab", type=int, default=50257, help="vocabulary (GPT-2: 50257)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds; each runs every variant once")
    args = parser.parse_args()
    from llmlab.core.runinfo import machine_label

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.width, generator=gen) * 0.5
    weight = torch.randn(args.vocab, args.width, generator=gen) * 0.02
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    variants = {"full logits": full_logits, "chunked, before": chunked_before, "chunked, now": chunked_now}
    times: dict[str, list[float]] = {name: [] for name in variants}
    results = {}
    for round_ in range(args.repeats + 1):  # round 0 warms up and is not timed
        for name, fn in variants.items():
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            start = time.perf_counter()
            loss = fn(h, w, labels)
            if round_:
                times[name].append(time.perf_counter() - start)
            results[name] = (float(loss.detach()), h.grad, w.grad)
    print(
        f"{machine_label()}, {torch.get_num_threads()} threads, torch {torch.__version__}; {args.tokens} tokens x "
        f"width {args.width} x vocab {args.vocab}, fp32, median of {args.repeats}"
    )
    reference = statistics.median(times["full logits"])
    ref_loss, ref_gh, ref_gw = results["full logits"]
    print(f"{'head + loss, fwd + bwd':24} {'ms':>8} {'speed vs full':>14} {'|d loss|':>10} {'|d grad|':>10}")
    for name, ts in times.items():
        loss, gh, gw = results[name]
        diff = max(float((gh - ref_gh).abs().max()), float((gw - ref_gw).abs().max()))
        print(
            f"{name:24} {statistics.median(ts) * 1e3:8.1f} {reference / statistics.median(ts):13.2f}x "
            f"{abs(loss - ref_loss):10.1e} {diff:10.1e}"
        )


if __name__ == "__main__":
    main()
