#!/usr/bin/env python
"""Training throughput, peak memory and loss: llmlab's pretraining (as the README launches it) vs transformers' Trainer.

Same GPT-2 preset, data blocks, micro-batch, AdamW settings, clipping 1.0 and cosine schedule, for the same number
of steps, every run in a fresh process. llmlab runs through the README's own command (`python train_pretrain.py`,
so its defaults: bf16 autocast where the CPU has bf16 units, the fused GELU, the chunked head); the Trainer runs
with its defaults (fp32) and, as a second baseline, with bf16=True. Throughput is taken between the end of step
`--skip` and the last step from each trainer's own per-step timestamps (start-up, data and compilation left out);
loss is the mean training loss of the last 5 steps. Runs alternate per seed; the table gives medians over seeds and
the loss difference with a 95 % CI from the seed spread.

    python bench/pretrain_throughput.py                          # gpt2-tiny, CPU, ~10 minutes on 2 cores
    python bench/pretrain_throughput.py --model gpt2 --block_size 1024 --batch_size 8 --steps 12 --seeds 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def tokens_per_sec(step_times: dict[int, float], skip: int, tokens_per_step: int) -> float:
    last = max(step_times)
    return (last - skip) * tokens_per_step / (step_times[last] - step_times[skip])


def common_options(args, seed: int) -> list[str]:
    return [
        "--model",
        args.model,
        "--block_size",
        str(args.block_size),
        "--batch_size",
        str(args.batch_size),
        "--effective_batch_size",
        str(args.batch_size),
        "--max_steps",
        str(args.steps),
        "--warmup_steps",
        "1",
        "--max_documents",
        str(args.max_documents),
        "--val_fraction",
        "0",
        "--save_every",
        str(10**9),
        "--seed",
        str(seed),
        "--log_every",
        "1",
        "--sample_tokens",
        "0",
    ]


def run_ours(args, seed: int) -> dict:
    """The README's command, as a user runs it; metrics.jsonl holds one timestamp per step."""
    from llmlab.core.io import read_jsonl

    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "train_pretrain.py", *common_options(args, seed), "--output_dir", out, *args.ours]
        proc = subprocess.run(
            ["/usr/bin/time", "-f", "%M", *cmd],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        if proc.returncode != 0:
            sys.exit(f"train_pretrain.py failed:\n{proc.stderr[-3000:]}")
        rows = [r for r in read_jsonl(Path(out) / "metrics.jsonl") if "train/loss" in r]
        times = {r["step"]: r["time"] for r in rows}
        return {
            "tokens_per_sec": tokens_per_sec(times, args.skip, args.batch_size * args.block_size),
            "peak_rss_mb": int(proc.stderr.strip().splitlines()[-1]) / 1024,
            "loss": statistics.mean(r["train/loss"] for r in rows[-5:]),
        }


def run_hf_trainer(args, seed: int, bf16: bool) -> dict:
    # long: the Trainer's arguments, its step-timing callback and the run, as its docs build one
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from llmlab.core.config import parse_config
    from llmlab.data.prepare import prepare_dataset
    from llmlab.data.tokenizer import load_tokenizer
    from llmlab.models.gpt2 import build_gpt2_model
    from llmlab.train.pretrain.config import PretrainConfig

    with tempfile.TemporaryDirectory() as out:
        cfg = parse_config(PretrainConfig, [*common_options(args, seed), "--output_dir", out])
        data = prepare_dataset(cfg.data_config(), load_tokenizer())
        torch.manual_seed(seed)
        model = build_gpt2_model(cfg.model)  # dropout 0, as train_pretrain.py
        times: dict[int, float] = {}
        losses: dict[int, float] = {}

        class StepTimes(TrainerCallback):
            def on_step_end(self, targs, state, control, **kwargs):
                if torch.cuda.is_available() and state.global_step in (args.skip, state.max_steps):
                    torch.cuda.synchronize()  # the timed steps' ends are the device's, not the launches'
                times[state.global_step] = time.time()

            def on_log(self, targs, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    losses[state.global_step] = logs["loss"]

        def collate(rows):
            ids = torch.stack([torch.as_tensor(r["input_ids"]) for r in rows])
            return {"input_ids": ids, "labels": ids}

        targs = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=cfg.batch_size,
            max_steps=cfg.max_steps,
            learning_rate=cfg.learning_rate,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            adam_epsilon=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            max_grad_norm=1.0,
            warmup_steps=1,
            lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr": cfg.min_lr},
            bf16=bf16,
            use_cpu=not torch.cuda.is_available(),
            logging_steps=getattr(args, "log_every", 1),  # as often as llmlab logs: a log is a host read
            save_strategy="no",
            eval_strategy="no",
            report_to=[],
            dataloader_num_workers=0,
            seed=seed,
            remove_unused_columns=False,
            disable_tqdm=True,
        )
        Trainer(
            model=model, args=targs, train_dataset=data.train, data_collator=collate, callbacks=[StepTimes()]
        ).train()
        last = sorted(losses)[-5:]
        return {
            "tokens_per_sec": tokens_per_sec(times, args.skip, cfg.batch_size * cfg.block_size),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "loss": statistics.mean(losses[s] for s in last),
        }


def fast_bf16() -> bool:
    import torch

    from llmlab.core.device import cpu_has_fast_bf16

    return torch.cuda.is_available() or cpu_has_fast_bf16()


def worker_result(args, worker: str, seed: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    cmd = [
        sys.executable,
        __file__,
        *sys.argv[1:],
        "--worker",
        worker,
        "--worker_seed",
        str(seed),
        "--result",
        result_path,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{worker} run failed:\n{proc.stderr[-3000:]}")
    result = json.loads(Path(result_path).read_text())
    os.unlink(result_path)
    return result


def report(args, results: dict[str, list[dict]]) -> None:
    from scipy import stats

    from llmlab.core.runinfo import hardware_info

    print(
        f"\n{args.model}, batch {args.batch_size} x {args.block_size} tokens, {args.steps} steps (first {args.skip} "
        f"untimed), {hardware_info().get('cpu_model')} ({os.cpu_count()} cores), {args.seeds} seed(s), medians"
    )
    ours = results["ours"]
    print(
        f"{'trainer':<34}{'tokens/s':>10}{'ratio (range)':>18}{'peak RSS MB':>13}{'loss (last 5)':>15}"
        f"{'Δloss vs ours, 95% CI':>30}"
    )
    for name, rows in results.items():
        tps = statistics.median(r["tokens_per_sec"] for r in rows)
        # per seed, the two runs made back to back: a shared machine's load moves both, so their ratio is steadier
        pairs = [a["tokens_per_sec"] / b["tokens_per_sec"] for a, b in zip(ours, rows)]
        ratio = statistics.median(pairs)
        spread = f" ({min(pairs):.2f}-{max(pairs):.2f})" if len(pairs) > 1 else ""
        losses = [r["loss"] for r in rows]
        delta = "-"
        if name != "ours" and len(rows) > 1:
            test = stats.ttest_ind(losses, [r["loss"] for r in ours], equal_var=False)
            ci = test.confidence_interval(0.95)
            delta = (
                f"{statistics.mean(losses) - statistics.mean(r['loss'] for r in ours):+.3f} "
                f"[{ci.low:+.3f}, {ci.high:+.3f}]"
            )
        label = {
            "ours": f"llmlab (python train_pretrain.py{' ' + ' '.join(args.ours) if args.ours else ''})",
            "hf": "transformers Trainer (fp32)",
            "hf_bf16": "transformers Trainer (bf16=True)",
        }[name]
        print(
            f"{label:<34}{tps:>10,.0f}{'' if name == 'ours' else f'{ratio:.2f}x{spread}':>18}"
            f"{statistics.median(r['peak_rss_mb'] for r in rows):>13,.0f}{statistics.mean(losses):>15.3f}{delta:>30}"
        )
    print("ratio = median over seeds of llmlab tokens/s / that trainer's tokens/s in the run made right after it")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--skip", type=int, default=10, help="steps left out of the timing (warm-up)")
    parser.add_argument("--max_documents", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=2, help="runs per trainer (seeds 0, 1, ...)")
    parser.add_argument("--ours", default="", help="extra train_pretrain.py flags in one string: --ours='--compile'")
    parser.add_argument("--no_bf16_trainer", action="store_true", help="skip the Trainer bf16 baseline")
    parser.add_argument("--worker", choices=["ours", "hf", "hf_bf16"], help=argparse.SUPPRESS)
    parser.add_argument("--worker_seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.ours = shlex.split(args.ours)
    if args.worker:
        result = (
            run_ours(args, args.worker_seed)
            if args.worker == "ours"
            else run_hf_trainer(args, args.worker_seed, bf16=args.worker == "hf_bf16")
        )
        Path(args.result).write_text(json.dumps(result))
        return
    workers = ["ours", "hf"] + ([] if args.no_bf16_trainer or not fast_bf16() else ["hf_bf16"])
    if "hf_bf16" not in workers and not args.no_bf16_trainer:
        print(
            "Trainer bf16 skipped: this machine has no bf16 units (no CUDA, no AVX512-BF16 or AMX), so bf16 is "
            "emulated there (a 40-step run did not finish in 20 minutes); llmlab's auto precision is fp32 here too",
            flush=True,
        )
    results: dict[str, list[dict]] = {w: [] for w in workers}
    for seed in range(args.seeds):
        for worker in workers:
            result = worker_result(args, worker, seed)
            results[worker].append(result)
            print(
                f"seed {seed} {worker:>8}: {result['tokens_per_sec']:,.0f} tokens/s, loss {result['loss']:.4f}",
                flush=True,
            )
    report(args, results)


if __name__ == "__main__":
    main()
