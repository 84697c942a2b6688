#!/usr/bin/env python
"""Training throughput and peak memory: llmlab's pretraining loop vs transformers' Trainer, side by side.

Both train the same GPT-2 (same preset, seed, data blocks, micro-batch, AdamW settings, grad clipping 1.0,
cosine schedule, precision) for the same number of steps, each in a fresh process so that peak memory is
its own (no validation split, so neither evaluates). Throughput is measured between the end of step `--skip` and the last step, from each trainer's own
per-step timestamps, so start-up, data preparation and the first (slow) steps are left out. Runs alternate
(ours, theirs, ours, ...) and the best of `--repeats` is kept, which damps noise from a shared machine.

    python bench/pretrain_throughput.py                          # gpt2-tiny, CPU, a few minutes
    python bench/pretrain_throughput.py --model gpt2 --block_size 1024 --batch_size 8 --mixed_precision bf16
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def peak_memory_mb() -> dict:
    import torch

    info = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if torch.cuda.is_available():
        info["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return info


def tokens_per_sec(step_times: dict[int, float], skip: int, tokens_per_step: int) -> float:
    last = max(step_times)
    return (last - skip) * tokens_per_step / (step_times[last] - step_times[skip])


def pretrain_config(args, output_dir: str):
    from llmlab.core.config import build_config
    from llmlab.train.pretrain import PretrainConfig

    return build_config(PretrainConfig, {
        "model": args.model, "n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head,
        "block_size": args.block_size, "batch_size": args.batch_size, "effective_batch_size": args.batch_size,
        "max_steps": args.steps, "warmup_steps": 1, "max_documents": args.max_documents, "output_dir": output_dir,
        "val_fraction": 0.0, "save_every": 10**9, "mixed_precision": args.mixed_precision, "seed": 0})


def run_ours(args) -> dict:
    from llmlab.core.io import read_jsonl
    from llmlab.train.pretrain import train

    with tempfile.TemporaryDirectory() as out:
        cfg = pretrain_config(args, out)
        train(cfg)
        times = {r["step"]: r["time"] for r in read_jsonl(Path(out) / "metrics.jsonl") if "train/loss" in r}
        return {"tokens_per_sec": tokens_per_sec(times, args.skip, cfg.batch_size * cfg.block_size), **peak_memory_mb()}


def run_hf_trainer(args) -> dict:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from llmlab.data.prepare import prepare_dataset
    from llmlab.models.gpt2 import build_gpt2_model
    from llmlab.data.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as out:
        cfg = pretrain_config(args, out)
        tokenizer = load_tokenizer()
        data = prepare_dataset(cfg.data_config(), tokenizer)
        torch.manual_seed(0)
        model = build_gpt2_model(cfg.model, n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head,
                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        times: dict[int, float] = {}

        class StepTimes(TrainerCallback):
            def on_step_end(self, targs, state, control, **kwargs):
                times[state.global_step] = time.time()

        def collate(rows):
            ids = torch.stack([torch.as_tensor(r["input_ids"]) for r in rows])
            return {"input_ids": ids, "labels": ids}

        targs = TrainingArguments(
            output_dir=out, per_device_train_batch_size=cfg.batch_size, max_steps=cfg.max_steps,
            learning_rate=cfg.learning_rate, adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2,
            adam_epsilon=cfg.adam_eps, weight_decay=cfg.weight_decay, max_grad_norm=1.0, warmup_steps=1,
            lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": cfg.min_lr},
            bf16=cfg.mixed_precision == "bf16", fp16=cfg.mixed_precision == "fp16", logging_steps=1,
            save_strategy="no", eval_strategy="no", report_to=[], dataloader_num_workers=0, seed=0,
            remove_unused_columns=False, disable_tqdm=True)
        Trainer(model=model, args=targs, train_dataset=data.train, data_collator=collate,
                callbacks=[StepTimes()]).train()
        return {"tokens_per_sec": tokens_per_sec(times, args.skip, cfg.batch_size * cfg.block_size), **peak_memory_mb()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--n_layer", type=int, default=None)
    parser.add_argument("--n_embd", type=int, default=None)
    parser.add_argument("--n_head", type=int, default=None)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=14, help="optimizer steps per run")
    parser.add_argument("--skip", type=int, default=4, help="steps left out of the timing (warm-up)")
    parser.add_argument("--mixed_precision", default=None, choices=["no", "bf16", "fp16"])
    parser.add_argument("--max_documents", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", choices=["ours", "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        result = run_ours(args) if args.worker == "ours" else run_hf_trainer(args)
        Path(args.result).write_text(json.dumps(result))
        return

    passthrough = sys.argv[1:]
    best: dict[str, dict] = {}
    for repeat in range(args.repeats):
        for worker in ("ours", "hf"):
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                result_path = f.name
            cmd = [sys.executable, __file__, *passthrough, "--worker", worker, "--result", result_path]
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{worker} run failed:\n{proc.stderr[-3000:]}")
            result = json.loads(Path(result_path).read_text())
            os.unlink(result_path)
            print(f"repeat {repeat + 1}/{args.repeats} {worker:>4}: {result['tokens_per_sec']:,.0f} tokens/s",
                  flush=True)
            if worker not in best or result["tokens_per_sec"] > best[worker]["tokens_per_sec"]:
                best[worker] = result

    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"\n{args.model} (n_layer={args.n_layer or 'preset'}, n_embd={args.n_embd or 'preset'}), "
          f"batch {args.batch_size} x {args.block_size} tokens, {args.steps} steps (first {args.skip} untimed), "
          f"precision {args.mixed_precision or 'no'}, {device}, best of {args.repeats}")
    memory_key = "peak_gpu_mb" if "peak_gpu_mb" in best["ours"] else "peak_rss_mb"
    memory_label = "peak GPU MiB" if memory_key == "peak_gpu_mb" else "peak RSS MiB"
    print(f"{'trainer':<26}{'tokens/s':>12}{memory_label:>16}")
    print(f"{'llmlab train_pretrain':<26}{best['ours']['tokens_per_sec']:>12,.0f}{best['ours'][memory_key]:>16,.0f}")
    print(f"{'transformers Trainer':<26}{best['hf']['tokens_per_sec']:>12,.0f}{best['hf'][memory_key]:>16,.0f}")
    print(f"{'ratio (llmlab / Trainer)':<26}{best['ours']['tokens_per_sec'] / best['hf']['tokens_per_sec']:>11.2f}x"
          f"{best['ours'][memory_key] / best['hf'][memory_key]:>15.2f}x")


if __name__ == "__main__":
    main()
