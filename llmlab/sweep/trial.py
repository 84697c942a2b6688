"""One sweep trial, run in its own process: `python -m llmlab.sweep.trial TRIAL_DIR/spec.json`.

Reads the spec the runner wrote, trains with the fail-safes (10-step pre-check; diverging, exploding and flat
losses stop the run; one retry with a fallback), evaluates, and writes TRIAL_DIR/result.json atomically.
No result.json after the process ends means it crashed or was killed; the runner records that.
Heavy imports sit at module level so a forkserver can preload them once for every trial.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from llmlab.core.notices import quiet_known_notices

quiet_known_notices()  # before transformers.optimization imports peft -> bitsandbytes (the forkserver preloads us)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402

from llmlab.core.device import cpu_has_fast_bf16, peak_rss_mb  # noqa: E402
from llmlab.core.errors import UserError  # noqa: E402
from llmlab.core.io import atomic_write_json  # noqa: E402
from llmlab.core.runinfo import machine_label  # noqa: E402
from llmlab.core.tracking import MetricsLogger  # noqa: E402
from llmlab.models.mup import hidden_matrices, lr_multipliers  # noqa: E402
from llmlab.models.registry import MODELS, build_model, non_embedding_parameters  # noqa: E402
from llmlab.sweep import metrics as M  # noqa: E402
from llmlab.sweep.failsafes import FailSafes, TrialStop, fallback, precheck  # noqa: E402
from llmlab.sweep.isolation import die_with_parent, release_compile_workers, watch_driver  # noqa: E402
from llmlab.sweep.probes import forward_logits, grad_param_ratios, probe_entropy, probe_loss, update_ratios  # noqa: E402
from llmlab.sweep.spec import SPLITS, Hparams, TrialSpec  # noqa: E402
from llmlab.train.batches import Batches  # noqa: E402
from llmlab.train.engine import Engine, GradClipper, TorchBackend  # noqa: E402
from llmlab.train.evaluation import evaluate_rows  # noqa: E402
from llmlab.train.loss import causal_lm_loss  # noqa: E402
from llmlab.train.optim import build_optimizer, build_schedule  # noqa: E402

RESULT_NAME = "result.json"
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build_trial_model(spec: TrialSpec, hp: Hparams) -> torch.nn.Module:
    """The trial's model through the registry every trainer builds with (llmlab.models.registry)."""
    options = dict(head_dim=MODELS[spec.model].probe_head_dim(spec.head_dim))
    if spec.model == "minimal":
        options.update(
            embedding=spec.embedding,
            position_encoding=hp.position_encoding,
            gradient_checkpointing=spec.gradient_checkpointing,
        )
    model = build_model(
        spec.model,
        spec.model_width,
        spec.model_depth,
        spec.block_size,
        spec.parametrization,
        spec.mup_base_width,
        **options,
    )
    if spec.gradient_checkpointing and spec.model != "minimal":
        model.gradient_checkpointing_enable()
    return model


def warmup_steps(spec: TrialSpec, hp: Hparams) -> int:
    return max(0, round(hp.warmup * spec.warmup_scale))


@dataclass
class TrialSetup:
    """Everything one attempt trains with; built fresh (same seed) for the retry."""

    model: torch.nn.Module
    params: list
    optimizer: Any
    scheduler: Any
    clipper: GradClipper
    engine: Engine  # the trainers' step (llmlab.train.engine), on plain torch with the trial's GradScaler
    loss_fn: Callable
    autocast: Callable[[], Any]
    batch: int
    micro: int
    warmup: int


def build_setup(spec: TrialSpec, hp: Hparams, device: torch.device) -> TrialSetup:
    set_seed(spec.seed)
    model = build_trial_model(spec, hp).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    by_name, hidden = lr_multipliers(model), hidden_matrices(model)  # muP's per-layer lrs; what Muon steps apart
    multipliers = {id(p): by_name[n] for n, p in model.named_parameters() if p.requires_grad}
    matrices = {id(p): hidden[n] for n, p in model.named_parameters() if n in hidden}
    optimizer = build_optimizer(
        hp.optimizer, params, hp.lr, hp.weight_decay, lr_multipliers=multipliers, matrices=matrices
    )
    steps, warmup = spec.steps, warmup_steps(spec, hp)
    scheduler = build_schedule(optimizer, hp.scheduler, warmup, steps)
    dtype = AUTOCAST_DTYPES.get(spec.precision)
    smoothing = hp.label_smoothing

    def autocast():
        return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def loss_of(chunk, labels):  # the autocast region is inside, so a compiled graph holds the casts too
        with autocast():
            return causal_lm_loss(forward_logits(model, chunk), labels, smoothing)

    batch = hp.batch_size
    micro = batch // hp.accumulation if hp.accumulation > 1 else min(spec.micro_batch_size or batch, batch)
    scaler = torch.amp.GradScaler(device.type, init_scale=1024, enabled=dtype is torch.float16)
    return TrialSetup(
        model=model,
        params=params,
        optimizer=optimizer,
        scheduler=scheduler,
        clipper=GradClipper(hp.clip, warmup_steps=warmup, clip_mode=hp.clip_mode),
        engine=Engine(TorchBackend(scaler)),
        loss_fn=torch.compile(loss_of) if spec.compile else loss_of,
        autocast=autocast,
        batch=batch,
        micro=micro,
        warmup=warmup,
    )


@dataclass
class StepOutcome:
    loss: float  # mean training loss of the step's micro batches
    grad_norm: float  # before clipping
    clipped: bool  # whether the clip bound was active
    lr: float  # the lr the step used
    skipped: bool  # fp16: the scaler found an overflow and skipped the update
    seconds: float  # the step's time, without the ratio measurements (they are not training)
    update_ratio: Optional[dict] = None  # |update| / |param| per layer group, on measured steps
    grad_ratio: Optional[dict] = None  # |grad| / |param| per layer group, on measured steps


def train_step(s: TrialSetup, ids: torch.Tensor, labels: torch.Tensor, step: int, measure: bool) -> StepOutcome:
    """One optimizer step through the engine: backward over the micro batches (gradient accumulation), clip, update,
    schedule. `measure` also records both update ratios (a parameter snapshot costs a copy, so only on logged
    steps), from a hook that sees the clipped gradients before the update; its time is not the step's."""
    started, probes = time.perf_counter(), {}
    chunks = list(zip(ids.split(s.micro), labels.split(s.micro)))
    for chunk, chunk_labels in chunks:
        s.engine.backward(s.loss_fn(chunk, chunk_labels), len(chunk), s.batch)

    def inspect():
        measuring = time.perf_counter()
        probes["grad"] = grad_param_ratios(s.model)
        probes["snapshot"] = {n: p.detach().clone() for n, p in s.model.named_parameters() if p.requires_grad}
        probes["seconds"] = time.perf_counter() - measuring

    out = s.engine.step(s.params, s.optimizer, s.scheduler, s.clipper, step, inspect if measure else None).read()
    loss_sum = 0.0
    for value, (chunk, _) in zip(out.losses, chunks):
        loss_sum += value * len(chunk) / s.batch
    seconds = time.perf_counter() - started - probes.get("seconds", 0.0)
    update = update_ratios(s.model, probes["snapshot"]) if measure and not out.overflow else None
    grad_ratio = probes.get("grad") if not out.overflow else None
    return StepOutcome(loss_sum, out.grad_norm, out.clipped, out.lr, out.overflow, seconds, update, grad_ratio)


def train_attempt(
    spec: TrialSpec, hp: Hparams, data: dict, device: torch.device, log_dir: Path, started: float
) -> dict:
    """Train once with hyperparameters `hp`; returns the curves and metrics, or raises TrialStop."""
    s = build_setup(spec, hp, device)
    batches = Batches(data["train"], spec.seed, spec.block_size, hp.loss_mask, hp.token_mask_ratio)
    probe = torch.from_numpy(np.asarray(data["validation"][: min(4, len(data["validation"]))], dtype=np.int64)).to(
        device
    )
    logger = MetricsLogger(log_dir, spec.report_to, {k: v for k, v in asdict(hp).items() if v is not None})
    safes = FailSafes(spec, lambda: probe_loss(s.model, s.autocast, probe))
    curves: dict[str, list] = {"loss": [], "grad_norm": [], "lr": [], "attention_entropy": []}
    ratios: dict[str, dict[str, list[float]]] = {"update": {}, "grad": {}}
    step_times, counts = [], {"clipped": 0, "skipped": 0}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        s.model.train()
        for step in range(spec.steps):
            measure = step % spec.log_every == 0 or step == spec.steps - 1
            tick = time.perf_counter()
            ids, labels = batches.take(s.batch)
            ids, labels = ids.to(device), labels.to(device)
            loading = time.perf_counter() - tick
            out = train_step(s, ids, labels, step, measure)
            step_times.append(loading + out.seconds)
            counts["clipped"] += int(out.clipped)
            counts["skipped"] += int(out.skipped)
            for name, value in (("loss", out.loss), ("grad_norm", out.grad_norm), ("lr", out.lr)):
                curves[name].append(value)
            for kind, measured in (("update", out.update_ratio), ("grad", out.grad_ratio)):
                for group, value in (measured or {}).items():
                    ratios[kind].setdefault(group, []).append(value)
            if measure:
                curves["attention_entropy"].append([step, probe_entropy(s.model, s.autocast, probe)])
            _log_step(spec, logger, step, curves, step_times[-1], measure)
            safes.check(step, out.loss, out.grad_norm, out.skipped)
            precheck(spec, step, step_times, started)
        rows = data["validation"][: spec.eval_batches * spec.eval_batch_size]
        evaluation = evaluate_rows(s.model, rows, spec.micro_batch_size or spec.eval_batch_size, device, s.autocast)
        logger.log({"eval/loss": evaluation["val_loss"], "eval/perplexity": evaluation["val_perplexity"]}, spec.steps)
    except TrialStop as stop:
        stop.curves = curves  # kept in result.json so a failed run's curve can still be inspected
        if len(curves["loss"]) <= spec.precheck_steps and not stop.reason.startswith("pre-check"):
            stop.reason = f"pre-check: {stop.reason}"
        raise
    finally:
        logger.flush()
    summary = summarise(spec, s, curves, ratios, step_times, counts, evaluation, device)
    write_hparams(logger, summary)
    logger.close()
    return {"summary": summary, "curves": curves}


def _log_step(spec: TrialSpec, logger: MetricsLogger, step: int, curves: dict, seconds: float, measured: bool) -> None:
    if measured:
        loss, norm, lr = curves["loss"][-1], curves["grad_norm"][-1], curves["lr"][-1]
        entropy = curves["attention_entropy"][-1][1] if curves["attention_entropy"] else None
        logger.log(
            {
                "train/loss": loss,
                "train/grad_norm": norm,
                "train/lr": lr,
                **({"train/attention_entropy": entropy} if entropy is not None else {}),
            },
            step,
        )
        print(
            f"step {step:>5}/{spec.steps}  loss {loss:.4f}  grad_norm {norm:.3g}  lr {lr:.3g}  {seconds:.3f} s/step",
            flush=True,
        )


def summarise(
    spec: TrialSpec,
    s: TrialSetup,
    curves: dict,
    ratios: dict,
    step_times: list[float],
    counts: dict,
    evaluation: dict,
    device: torch.device,
) -> dict:
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else peak_rss_mb()
    timed = step_times[spec.precheck_steps :] or step_times
    grad_mean, grad_std = M.mean_std(curves["grad_norm"])
    return {
        "initial_loss": curves["loss"][0],  # L_init of the lr-sensitivity measure (Wortsman et al. 2023)
        "final_train_loss": float(np.mean(curves["loss"][-10:])),
        "final_loss": evaluation["val_loss"],
        **evaluation,
        "stability_index": M.stability_index(curves["loss"]),
        "initial_loss_slope": M.initial_loss_slope(curves["loss"]),
        "early_loss_std": M.early_loss_std(curves["loss"]),
        "grad_norm_mean": grad_mean,
        "grad_norm_std": grad_std,
        "clipped_steps": counts["clipped"],
        "skipped_steps": counts["skipped"],
        # two definitions, both named: |update| / |param| (what the step did) and |grad| / |param| (the original lab's)
        "update_ratio": {g: float(np.mean(v)) for g, v in ratios["update"].items()},
        "update_ratio_mean": float(np.mean([np.mean(v) for v in ratios["update"].values()]))
        if ratios["update"]
        else None,
        "grad_param_ratio": {g: float(np.mean(v)) for g, v in ratios["grad"].items()},
        "grad_param_ratio_mean": (
            float(np.mean([np.mean(v) for v in ratios["grad"].values()])) if ratios["grad"] else None
        ),
        "peak_memory_mb": round(peak, 1),
        # only a GPU peak calibrates recommend's memory model; a CPU RSS is mostly torch itself
        "memory_source": "cuda" if device.type == "cuda" else "cpu_rss",
        "model_width": spec.model_width,
        "model_depth": spec.model_depth,
        "seq_len": spec.block_size,
        "micro_batch_size": s.micro,
        "time_per_step_s": float(np.mean(timed)),
        "tokens_per_s": s.batch * spec.block_size / float(np.median(timed)),
        "train_tokens": spec.steps * s.batch * spec.block_size,
        "n_params": non_embedding_parameters(s.model),
        "n_params_total": sum(p.numel() for p in s.model.parameters()),
        # C = 6 N D (Kaplan et al.), the compute the scaling-law comparisons are stated in
        "compute_flops": 6.0 * non_embedding_parameters(s.model) * spec.steps * s.batch * spec.block_size,
        "warmup_steps": s.warmup,
        "accumulation_steps": math.ceil(s.batch / s.micro),
        "precision": spec.precision,
        "compiled": bool(spec.compile),
    }


def write_hparams(logger: MetricsLogger, summary: dict) -> None:
    """The run's entry in TensorBoard's HParams tab (its levels were recorded when the logger started, in the same
    run folder as its curves): these scalars, hparam/final_loss included, are the metrics TensorBoard shows."""
    logger.log_summary(
        {
            f"hparam/{k}": summary[k]
            for k in ("final_loss", "stability_index", "grad_norm_mean", "time_per_step_s")
            if summary.get(k) is not None
        }
    )


def load_data(data_dir: Path) -> dict:
    return {split: np.load(data_dir / f"{split}.npy", mmap_mode="r") for split in SPLITS}


def run_trial(spec_path: str | Path) -> dict:
    started = time.time()
    spec = TrialSpec.read(spec_path)
    watch_driver(spec.driver)
    if spec.device == "cpu" and spec.precision == "bf16" and not cpu_has_fast_bf16():  # e.g. a Ray node without
        raise UserError(
            f"trial {spec.trial_id} trains in bf16 and {machine_label()} has no bf16 units (emulated, "
            "tens of times slower): run it on a CPU with AVX512-BF16 or AMX, or sweep in fp32"
        )
    trial_dir = Path(spec.trial_dir)
    threads = spec.threads
    if threads:
        torch.set_num_threads(threads)
    device = torch.device("cuda" if spec.device == "cuda" else "cpu")
    data = load_data(Path(spec.data_dir))
    data_loaded = time.time() - started
    hp = spec.hparams
    result = _result_header(spec)
    print(f"[{spec.trial_id}] {spec.steps} steps, model {spec.model}, seed {spec.seed}, {hp}", flush=True)
    for attempt in (1, 2):
        result["attempts"] = attempt
        log_dir = trial_dir if attempt == 1 else trial_dir / "retry"
        try:
            outcome = train_attempt(spec, hp, data, device, log_dir, started)
            result.update(status="ok", effective_hparams=asdict(hp), **outcome["summary"], curves=outcome["curves"])
            break
        except TrialStop as stop:
            print(f"[{spec.trial_id}] fail-safe: {stop.reason}", flush=True)
            result["failures"].append(stop.reason)
            # a projected overrun says how busy the machine is, not how good the hparams are: it is a timeout,
            # which a resume reruns, never a finished "failed" outcome
            status = "timeout" if stop.kind == "slow" else "failed"
            result.update(status=status, effective_hparams=asdict(hp), curves=stop.curves)
            plan = fallback(hp, stop) if spec.retry and attempt == 1 else None
            if plan is None:
                break
            hp, result["fallback"] = plan
            result["boundary"] = True
            print(f"[{spec.trial_id}] retrying once with {result['fallback']}", flush=True)
        except torch.cuda.OutOfMemoryError as err:
            result.update(status="oom", failures=result["failures"] + [f"CUDA out of memory: {str(err)[:200]}"])
            break
    result["startup_s"] = round(data_loaded, 3)
    result["wall_time_s"] = round(time.time() - started, 3)
    atomic_write_json(trial_dir / RESULT_NAME, result)
    print(f"[{spec.trial_id}] {result['status']} in {result['wall_time_s']:.1f} s", flush=True)
    return result


def _result_header(spec: TrialSpec) -> dict[str, Any]:
    """What result.json says of a trial whatever its outcome: who ran it, where, and with which settings."""
    return {
        "trial_id": spec.trial_id,
        "node": socket.gethostname(),
        "cpu": machine_label(),
        "hparams": asdict(spec.hparams),
        "model": spec.model,
        "steps": spec.steps,
        "seed": spec.seed,
        "replicate": spec.replicate,
        "attempts": 0,
        "boundary": False,
        "failures": [],
        "fallback": None,
        **({"registration": spec.registration} if spec.registration else {}),
    }


def child_main(spec_path: str, log_path: str, env: dict[str, str]) -> None:
    """Entry point of a forkserver-launched trial: log to its own file, then run (exit code 0/1)."""
    die_with_parent()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.update(env)
    code = 0
    try:
        run_trial(spec_path)
    except BaseException:
        traceback.print_exc()
        code = 1
    release_compile_workers()
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m llmlab.sweep.trial TRIAL_DIR/spec.json")
    die_with_parent()
    run_trial(sys.argv[1])
