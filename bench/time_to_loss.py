"""The quick start judged by what it learns in its time: validation loss against training wall time, side by side.

Three recipes train the quick start's model (gpt2-tiny) on its data (builtin:wiki, blocks of 128) for its length (190
steps of 8 sequences), each in a fresh process, one seed after another:
- llmlab: `python train_pretrain.py` as the README runs it (its defaults: bf16 autocast where the CPU has bf16 units,
  the chunked head, fused AdamW, lr 2e-3, cosine to 1e-5 after a 10 % warmup), plus any `--variant` flags;
- nanoGPT's recipe: a plain PyTorch GPT-2 of the same shape (gpu_throughput.nanogpt_model: SDPA attention, tied
  head, full logits), its AdamW (betas 0.9 / 0.95, weight decay 0.1 on matrices), bf16 autocast, clip 1.0, and its
  schedule (linear warmup, cosine to lr / 10) at llmlab's peak lr and warmup;
- transformers' Trainer: bf16, SDPA attention, the same AdamW settings and cosine schedule as llmlab.
Every recipe scores the same validation blocks (the first 20 batches of the quick start's validation split) every
--eval_every steps with its training clock stopped, so the curve is validation loss against training seconds.
From each curve: the training seconds to reach --target (linear between evaluations) and the loss at --at_seconds
(default: the shortest run's length). Medians over seeds; a recipe that never reaches the target says so. Against
the first recipe (the reference), paired by seed, since a seed's recipes run back to back: the loss at that time minus
the reference's, with its 95 % t interval on seeds - 1 df, and the time to the target over the reference's.

    python bench/time_to_loss.py --seeds 3 --output docs/findings/quickstart/time_to_loss.json
    python bench/time_to_loss.py --variant muon-wsd='--optimizer muon --lr_scheduler wsd'
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

STEPS, BATCH, BLOCK, LR, MIN_LR = 190, 8, 128, 2e-3, 1e-5  # the quick start (llmlab.train.pretrain.config)
EVAL_BATCHES = 20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="runs per recipe")
    parser.add_argument("--eval_every", type=int, default=10, help="steps between validation scores")
    parser.add_argument("--target", type=float, default=7.3, help="validation loss whose time is compared")
    parser.add_argument("--at_seconds", type=float, default=None, help="where losses are compared (default: shortest)")
    parser.add_argument("--recipes", nargs="+", default=["llmlab", "nanogpt", "trainer"], help="which to run")
    parser.add_argument(
        "--variant", action="append", default=[], help="NAME='FLAGS': llmlab with these flags, as one more recipe"
    )
    parser.add_argument("--output", type=Path, help="write every curve and the table as JSON here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def llmlab_curve(flags: list[str], seed: int, eval_every: int) -> list[tuple[float, float]]:
    """(training seconds, validation loss) of `python train_pretrain.py`: its log windows' tokens over their tokens/s
    add up to the training clock (llmlab's meter stops it for evaluations and saves)."""
    from llmlab.core.io import read_jsonl

    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "train_pretrain.py", "--output_dir", out, "--seed", str(seed), "--sample_tokens", "0"]
        cmd += ["--eval_every", str(eval_every), "--log_every", str(eval_every), "--report_to", "none", *flags]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{shlex.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        rows = read_jsonl(Path(out) / "metrics.jsonl")
    clock, seen, at_step = 0.0, 0, {}
    for row in rows:
        if "train/loss" in row:
            clock += (row["train/tokens_seen"] - seen) / row["train/tokens_per_sec"]
            seen = row["train/tokens_seen"]
            at_step[row["step"]] = clock
    return [(at_step[r["step"]], r["val/loss"]) for r in rows if "val/loss" in r and r["step"] in at_step]


def quickstart_data():
    from llmlab.core.config import parse_config
    from llmlab.data.prepare import prepare_dataset
    from llmlab.data.tokenizer import load_tokenizer
    from llmlab.train.pretrain.config import PretrainConfig

    cfg = parse_config(PretrainConfig, ["--output_dir", "/tmp/unused"])
    return prepare_dataset(cfg.data_config(), load_tokenizer())


def validation_loss(loss_of, val) -> float:
    import torch

    with torch.no_grad():
        losses = [float(loss_of(val[i : i + BATCH])) for i in range(0, EVAL_BATCHES * BATCH, BATCH)]
    return sum(losses) / len(losses)


def nanogpt_curve(seed: int, eval_every: int) -> list[tuple[float, float]]:
    """nanoGPT's loop on the quick start's blocks, its clock stopped while it scores the validation blocks."""
    import numpy as np
    import torch
    from gpu_throughput import nanogpt_model

    from llmlab.models.gpt2 import GPT2_PRESETS
    from llmlab.train.components import lr_multiplier

    data, preset = quickstart_data(), GPT2_PRESETS["gpt2-tiny"]
    rows = torch.as_tensor(np.asarray(data.train.with_format("numpy")["input_ids"]).astype(np.int64))
    val = torch.as_tensor(np.asarray(data.validation.with_format("numpy")["input_ids"]).astype(np.int64))
    torch.manual_seed(seed)
    model = nanogpt_model(preset["n_layer"], preset["n_embd"], preset["n_head"], BLOCK)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), fused=True)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
    clock, curve = 0.0, []
    for step in range(STEPS):
        started = time.perf_counter()
        for group in optimizer.param_groups:  # nanoGPT's get_lr: warmup, then cosine to lr / 10
            group["lr"] = LR * lr_multiplier(step, "cosine", STEPS // 10, STEPS, 0.1)
        ids = rows[order[(step * BATCH) % len(rows) : (step * BATCH) % len(rows) + BATCH]]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock += time.perf_counter() - started
        if (step + 1) % eval_every == 0 or step + 1 == STEPS:
            model.eval()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                curve.append((clock, validation_loss(model, val)))
            model.train()
    return curve


def trainer_curve(seed: int, eval_every: int) -> list[tuple[float, float]]:
    """transformers' Trainer, its clock the sum of its steps' times (a callback), evaluations outside it."""
    import numpy as np
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from llmlab.models.gpt2 import build_gpt2_model
    from llmlab.train.loss import CausalLMWithLoss

    data = quickstart_data()
    val = torch.as_tensor(np.asarray(data.validation.with_format("numpy")["input_ids"]).astype(np.int64))
    torch.manual_seed(seed)
    model = build_gpt2_model("gpt2-tiny")
    scorer = CausalLMWithLoss(model, 0.0, 0)
    clock, curve = {"total": 0.0, "started": 0.0}, []

    class Clock(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kwargs):
            clock["started"] = time.perf_counter()

        def on_step_end(self, targs, state, control, **kwargs):
            clock["total"] += time.perf_counter() - clock["started"]
            if state.global_step % eval_every == 0 or state.global_step == STEPS:
                model.eval()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    curve.append((clock["total"], validation_loss(scorer, val)))
                model.train()

    def collate(rows):
        ids = torch.stack([torch.as_tensor(r["input_ids"]) for r in rows])
        return {"input_ids": ids, "labels": ids}

    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out, per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=LR, adam_beta2=0.98,
            adam_epsilon=1e-6, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=STEPS // 10,
            lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": MIN_LR}, bf16=True, use_cpu=True,
            logging_steps=eval_every, save_strategy="no", eval_strategy="no", report_to=[], seed=seed,
            dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True,
        )  # fmt: skip
        Trainer(model=model, args=targs, train_dataset=data.train, data_collator=collate, callbacks=[Clock()]).train()
    return curve


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """Training seconds at which the validation loss first reaches `target`, linear between evaluations."""
    previous = (0.0, math.inf)
    for seconds, loss in curve:
        if loss <= target:
            if not math.isfinite(previous[1]):
                return seconds
            share = (previous[1] - target) / (previous[1] - loss)
            return previous[0] + share * (seconds - previous[0])
        previous = (seconds, loss)
    return None


def loss_at(curve: list[tuple[float, float]], seconds: float) -> float:
    """Validation loss at `seconds` of training, linear between evaluations (the last one past the curve's end)."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= seconds <= t1:
            return l0 + (l1 - l0) * (seconds - t0) / (t1 - t0)
    return curve[-1][1] if seconds >= curve[-1][0] else curve[0][1]


def run_recipe(name: str, flags: str, seed: int, eval_every: int) -> list:
    """One recipe and seed in a fresh process (this script as its worker)."""
    cmd = [sys.executable, __file__, "--worker", name, "--seed", str(seed), "--eval_every", str(eval_every)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LLMLAB_BENCH_FLAGS": flags}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"{name} seed {seed} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def paired(values: list[float], base: list[float]) -> dict:
    """values - base seed by seed (a seed's recipes ran back to back): the mean with its 95 % t interval on n - 1 df."""
    from scipy import stats

    diffs = [a - b for a, b in zip(values, base)]
    mean, df = statistics.fmean(diffs), len(diffs) - 1
    if df < 1:
        return {"mean": mean, "ci95": None, "df": 0, "per_seed": diffs}
    half = stats.t.ppf(0.975, df) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return {"mean": mean, "ci95": [mean - half, mean + half], "df": df, "per_seed": diffs}


def summary(curves: dict, target: float, at_seconds: float | None) -> dict:
    """Per recipe: medians over seeds, and against the first recipe (the reference), paired by seed: the loss at
    `at` seconds minus the reference's, and the time to `target` over the reference's."""
    at = at_seconds or min(c[-1][0] for runs in curves.values() for c in runs)
    reference = next(iter(curves))
    table = {}
    for name, runs in curves.items():
        reached = [time_to(c, target) for c in runs]
        times = [t for t in reached if t is not None]
        row = {
            "seconds_to_target": statistics.median(times) if len(times) == len(runs) else None,
            "reached": f"{len(times)} of {len(runs)}",
            "per_seed_seconds_to_target": reached,
            "loss_at": statistics.median(loss_at(c, at) for c in runs),
            "per_seed_loss_at": [loss_at(c, at) for c in runs],
            "final_loss": statistics.median(c[-1][1] for c in runs),
            "train_seconds": statistics.median(c[-1][0] for c in runs),
        }
        if name != reference:
            base = table[reference]
            row["loss_at_minus_reference"] = paired(row["per_seed_loss_at"], base["per_seed_loss_at"])
            lengths = [c[-1][0] / b[-1][0] for c, b in zip(runs, curves[reference])]
            row["train_seconds_ratio"] = statistics.median(lengths)  # the same steps: the step's speed, inverted
            ratios = [a / b for a, b in zip(reached, base["per_seed_seconds_to_target"]) if a and b]
            row["time_ratio"] = (
                {"median": statistics.median(ratios), "range": [min(ratios), max(ratios)], "pairs": len(ratios)}
                if ratios
                else None
            )
        table[name] = row
    return {"target": target, "at_seconds": at, "reference": reference, "table": table}


def format_table(result: dict) -> str:
    """The table the bench prints: medians over seeds, then each recipe against the reference, paired by seed."""
    target, ref = result["target"], result["reference"]
    at = f"loss at {result['at_seconds']:.0f} s"
    lines = [f"{'recipe':<16}{'s to ' + str(target):>12}{'reached':>9}{at:>16}{'final loss':>12}{'train s':>9}"
             f"{'/ ' + ref:>9}  {'loss - ' + ref + ' [95 % CI, df]':<34}{'time / ' + ref:>22}"]  # fmt: skip
    for name, row in result["table"].items():
        to = f"{row['seconds_to_target']:.0f}" if row["seconds_to_target"] is not None else "-"
        delta, ratio, length = "reference", "", ""
        if name != ref:
            length = f"{row['train_seconds_ratio']:.2f}x"
            d = row["loss_at_minus_reference"]
            ci = f"[{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]" if d["ci95"] else "[-]"
            delta = f"{d['mean']:+.3f} {ci}, {d['df']}"
            r = row["time_ratio"]
            ratio = f"{r['median']:.2f}x ({r['range'][0]:.2f}-{r['range'][1]:.2f}, n={r['pairs']})" if r else "-"
        lines.append(f"{name:<16}{to:>12}{row['reached']:>9}{row['loss_at']:>16.3f}{row['final_loss']:>12.3f}"
                     f"{row['train_seconds']:>9.0f}{length:>9}  {delta:<34}{ratio:>22}")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        flags = shlex.split(os.environ.get("LLMLAB_BENCH_FLAGS", ""))
        workers = {"nanogpt": nanogpt_curve, "trainer": trainer_curve}
        curve = (workers[args.worker] if args.worker in workers else lambda s, e: llmlab_curve(flags, s, e))(
            args.seed, args.eval_every
        )
        print(json.dumps(curve))
        return 0
    from llmlab.core.runinfo import machine_label

    recipes = {name: "" for name in args.recipes} | dict(v.split("=", 1) for v in args.variant)
    curves = {name: [] for name in recipes}
    for seed in range(args.seeds):  # seed by seed, every recipe in turn: drift hits all alike
        for name, flags in recipes.items():
            worker = name if name in ("nanogpt", "trainer") else "llmlab"
            curves[name].append(run_recipe(worker, flags, seed, args.eval_every))
    result = summary(curves, args.target, args.at_seconds)
    print(format_table(result))
    if args.output:
        from llmlab.core.io import atomic_write_json

        args.output.parent.mkdir(parents=True, exist_ok=True)
        machine = {"machine": machine_label(), "recipes": recipes, "seeds": args.seeds, "eval_every": args.eval_every}
        atomic_write_json(args.output, {**result, **machine, "curves": curves})
    return 0


if __name__ == "__main__":
    sys.exit(main())
