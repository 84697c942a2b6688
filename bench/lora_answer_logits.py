#!/usr/bin/env python
"""LoRA training step: logits for every position (baseline) vs only where the loss needs them.

train_lora.py's loss ignores prompt tokens, so it projects to the vocabulary only at answer positions
("gather": final hidden states -> output layer on those rows; "trim": `logits_to_keep` from the batch's
first answer position). With GPT-2's 50257-token vocabulary that projection and the cross-entropy
dominate a small model's step; this measures the saving on real builtin:pydoc batches (default prompt
template): same weights, same batches, same dropout masks, variants interleaved step by step.

    python bench/lora_answer_logits.py                 # gpt2-tiny preset, 8 steps each, batch 16
    python bench/lora_answer_logits.py --model gpt2 --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    # long: options, model, batches and the timed step in order; the measuring and the table are functions
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="gpt2-tiny", help="llmlab.models.gpt2 preset (random init) or a model folder"
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant (after 1 warmup step each)")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--max_length", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()

    import torch

    from llmlab.core.notices import quiet_known_notices
    from llmlab.data.instruct import collate, load_records, split_records, tokenize_records
    from llmlab.data.tokenizer import load_tokenizer
    from llmlab.models.gpt2 import GPT2_PRESETS, build_gpt2_model
    from llmlab.train.lora.config import LoraTrainConfig, default_instruct_cache
    from llmlab.train.lora.evaluation import answer_logits, answer_loss
    from llmlab.train.lora.model import add_lora

    quiet_known_notices()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokenizer = load_tokenizer()
    if args.model in GPT2_PRESETS:
        model = build_gpt2_model(args.model)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model)
    cfg = LoraTrainConfig()
    model = add_lora(model, cfg)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)

    train, _ = split_records(load_records("builtin:pydoc", default_instruct_cache()), 0.1, cfg.data_seed)
    examples, _ = tokenize_records(
        tokenizer,
        train,
        min(args.max_length, model.config.max_position_embeddings),
        cfg.prompt_template,
        cfg.prompt_template_no_input,
    )
    batches = [
        collate(examples[i * args.batch_size : (i + 1) * args.batch_size], tokenizer.eos_token_id)
        for i in range(args.steps + 1)
    ]

    head = model.get_output_embeddings()
    variants = {"full": "all logits (baseline)", "trim": "logits_to_keep trim", "gather": "answer rows (train_lora)"}

    def step(batch, mode: str) -> tuple[float, float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        logits, targets, _ = answer_logits(model, batch, mode, head)
        loss = answer_loss(logits, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - wall, time.process_time() - cpu, loss.item()

    timings, losses = interleaved(step, batches, variants)
    report(args, batches, variants, timings, losses)


def interleaved(step, batches: list, variants: dict) -> tuple[dict, dict]:
    """Each variant's (wall, cpu) seconds and loss per batch, one warmup step each, the variants interleaved batch by
    batch (background load hits every variant alike) with the same LoRA dropout masks."""
    import torch

    timings = {mode: [] for mode in variants}
    losses = {mode: [] for mode in variants}
    for mode in variants:
        step(batches[0], mode)  # warmup
    for batch in batches[1:]:
        for mode in variants:
            with torch.random.fork_rng():
                torch.manual_seed(1)
                wall, cpu, loss = step(batch, mode)
            timings[mode].append((wall, cpu))
            losses[mode].append(loss)
    return timings, losses


def report(args, batches: list, variants: dict, timings: dict, losses: dict) -> None:
    import os

    tokens = sum(int(b["attention_mask"].sum()) for b in batches[1:]) / args.steps
    answer_share = sum(int((b["labels"] != -100).sum()) for b in batches[1:]) / args.steps / tokens
    max_loss_diff = max(abs(a - b) for mode in ("trim", "gather") for a, b in zip(losses["full"], losses[mode]))
    print(
        f"model {args.model}, {args.steps} steps of batch {args.batch_size} (~{tokens:.0f} tokens/step, "
        f"{100 * answer_share:.0f}% of them answer tokens), {args.threads} threads, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'variant':<28}{'wall ms/step':>14}{'cpu ms/step':>14}{'tokens/s':>12}{'wall ratio':>12}{'cpu ratio':>11}")
    base_wall = statistics.median(w for w, _ in timings["full"])
    base_cpu = statistics.median(c for _, c in timings["full"])
    for mode, name in variants.items():
        wall = statistics.median(w for w, _ in timings[mode])
        cpu = statistics.median(c for _, c in timings[mode])
        print(
            f"{name:<28}{1000 * wall:>14.0f}{1000 * cpu:>14.0f}{tokens / wall:>12.0f}{base_wall / wall:>11.2f}x"
            f"{base_cpu / cpu:>10.2f}x"
        )
    print(f"max |loss difference| vs baseline: {max_loss_diff:.2e} (same batches, same dropout masks)")


if __name__ == "__main__":
    main()
