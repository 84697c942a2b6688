"""`sweep.py recommend`: turn an lr_bs sweep's fits into a training config for a given memory budget.

Memory model (stated, deliberately conservative): activations grow with tokens per micro batch, so a run at
sequence length L and batch B is read off the measured fit at batch B * L / L_swept; a larger target model
(--params N) multiplies the whole prediction by N / N_swept. Weights, gradients and Adam states (~16 bytes
per parameter) scale exactly so; activations grow more slowly than params when a model is made wider, and
runtime overhead does not grow at all, so the scaled prediction errs on the high side. The prediction used
is the upper edge of the fit's bootstrap band, with a further `memory_headroom` (10 %) kept free: on a GPU
the sweep measures torch.cuda.max_memory_allocated, which leaves out the CUDA context and allocator cache.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import numpy as np
import yaml

from llmlab.core.config import add_dataclass_args, config_from_namespace, load_yaml, opt
from llmlab.core.errors import UserError
from llmlab.core.io import atomic_write_text
from llmlab.scaling.fits import ScalingOptions, predict_band
from llmlab.scaling.report import FITS_FILE, write_lr_bs_report

DEFAULT_SEQ_LEN = 1024  # train_pretrain.py's default block size, used when the sweep did not record one
MB_PER_GB = 1024  # peak memory is recorded in MiB; --memory-gb is GiB, as nvidia-smi and torch report it


@dataclass
class RecommendConfig(ScalingOptions):
    """Recommendation options; the inherited analysis options (thresholds, bootstrap) re-analyse the stored
    trials, and rewrite the sweep's scaling_fits.json / report / plots, when they differ from the stored ones."""

    from_dir: str = opt("", "output folder of `sweep.py --grid lr_bs` (holds scaling_fits.json); also --from")
    memory_gb: Optional[float] = opt(None, "memory of the target device in GiB (required); also --memory-gb")
    params: Optional[int] = opt(None, "non-embedding parameter count N of the target model (what the sweep "
                                "records and the lr fit uses); predicted memory is scaled by params / swept params; "
                                "unset = the swept model")
    tokens: Optional[int] = opt(None, "training tokens of the target run; sets max_steps and warmup "
                                "(unset = tokens_per_param x params, the Chinchilla ratio)")
    seq_len: Optional[int] = opt(None, "sequence length of the target run; unset = the sweep's")
    output: Optional[str] = opt(None, "YAML file to write; unset = FROM/recommended_config.yaml")
    memory_headroom: float = opt(0.10, "fraction of --memory-gb kept free on top of the band's upper edge "
                                 "(the measured GPU peak excludes the CUDA context and allocator cache)")
    max_extrapolation: float = opt(4.0, "never recommend a batch above this multiple of the largest swept "
                                   "batch: the fits are not trusted far outside their data")
    tokens_per_param: float = opt(20.0, "tokens per parameter when --tokens is not given")

    def validate(self) -> None:
        super().validate()
        if not self.from_dir:
            raise UserError("--from is required: pass the output folder of `python sweep.py --grid lr_bs`")
        if self.memory_gb is None or self.memory_gb <= 0:
            raise UserError("--memory-gb is required and must be > 0 (the target device's memory in GiB)")
        for name in ("params", "tokens", "seq_len"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UserError(f"--{name} must be > 0, got {value}")
        if not 0 <= self.memory_headroom < 1:
            raise UserError(f"--memory_headroom must be in [0, 1), got {self.memory_headroom}")
        if self.max_extrapolation < 1 or self.tokens_per_param <= 0:
            raise UserError("--max_extrapolation must be >= 1 and --tokens_per_param > 0")


def load_fits(from_dir: str) -> dict:
    folder = Path(from_dir)
    if not folder.is_dir():
        raise UserError(f"--from {folder}: folder not found; pass the output folder of `python sweep.py --grid lr_bs`")
    path = folder / FITS_FILE
    if not path.is_file():
        raise UserError(f"--from {folder}: no {FITS_FILE} (no finished lr_bs sweep there); run "
                        f"`python sweep.py --grid lr_bs --output_dir {folder}` first (rerunning a finished sweep "
                        f"with its original flags skips its trials and only rewrites the reports)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({err}); rerun the lr_bs sweep to rewrite it") from None


def _require(fits: dict, name: str) -> dict:
    fit = fits["fits"].get(name, {})
    if fit.get("status") != "ok":
        raise UserError(
            f"too few feasible trials to fit {name}: {fit.get('reason', 'missing')}; {fits['n_feasible']} of "
            f"{fits['n_trials']} trials were feasible -- rerun the lr_bs sweep with more batch sizes / lrs "
            f"(>= 3 batch sizes, >= 2 lrs each) or see the dropped trials in scaling_report.md")
    return fit


def _nearest_grad_norm(fits: dict, batch: int, lr: float) -> Optional[dict]:
    """The feasible trial closest to (batch, lr) in log space that recorded a mean grad norm."""
    trials = {t.get("trial_id"): t for t in fits["trials"]}
    candidates = [trials[i] for i in fits["feasible_ids"]
                  if isinstance(trials[i].get("grad_norm_mean"), (int, float))
                  and math.isfinite(trials[i]["grad_norm_mean"]) and trials[i]["grad_norm_mean"] > 0]
    if not candidates:
        return None
    return min(candidates, key=lambda t: math.log(float(t["batch_size"]) / batch) ** 2
               + math.log(float(t["lr"]) / lr) ** 2)


ANALYSIS_OPTIONS = tuple(f.name for f in fields(ScalingOptions))


def recommend(cfg: RecommendConfig, reanalyse: tuple[str, ...] = ()) -> dict:
    """`reanalyse` names the analysis options the user set; the stored analysis keeps all the others."""
    fits = load_fits(cfg.from_dir)
    stored = {k: v for k, v in fits.get("options", {}).items() if k in ANALYSIS_OPTIONS}
    options = ScalingOptions(**{**stored, **{name: getattr(cfg, name) for name in reanalyse}})
    if reanalyse and vars(options) != fits.get("options"):
        print(f"re-analysing the {fits['n_trials']} stored trials with the given analysis options "
              f"(rewrites {FITS_FILE}, the scaling report and plots)")
        write_lr_bs_report(cfg.from_dir, fits["trials"], options)
        fits = load_fits(cfg.from_dir)
    swept_params, swept_seq = fits["measured"].get("params"), fits["measured"].get("seq_len")
    if cfg.params is not None and not swept_params:
        raise UserError("--params needs the swept model's parameter count, which this sweep did not record; "
                        "drop --params to plan for the swept model itself")
    if cfg.seq_len is not None and not swept_seq:
        raise UserError("--seq_len needs the sweep's sequence length, which it did not record; drop --seq_len")
    notes: list[str] = []
    plan = _batch_plan(cfg, fits, _require(fits, "peak_memory_mb"), notes)
    plan.update(_learning_rate(cfg, fits, plan["batch_size"], notes))
    plan.update(_schedule(cfg, swept_params, plan["batch_size"], plan["seq_len"], notes))
    plan["expected_early_loss_std"] = None
    if fits["fits"].get("loss_std", {}).get("status") == "ok":
        point = np.array([[math.log(1 / plan["learning_rate"]), math.log(plan["batch_size"])]])
        plan["expected_early_loss_std"] = [float(math.exp(v[0])) for v in predict_band(
            fits["fits"]["loss_std"], point, fits["options"]["confidence"])]
    nearest = _nearest_grad_norm(fits, plan["batch_size"], plan["learning_rate"])
    plan["clip"] = round(1.5 * float(nearest["grad_norm_mean"]), 4) if nearest else None
    plan["clip_basis"] = (f"1.5 x mean grad norm {float(nearest['grad_norm_mean']):.4g} of trial {nearest['trial_id']} "
                          f"(lr {float(nearest['lr']):.3g}, batch {nearest['batch_size']})") if nearest else None
    if nearest is None:
        notes.append("no grad norms recorded: clip left to the trainer's default")
    return {**plan, "confidence": fits["options"]["confidence"], "notes": notes}


def _batch_plan(cfg: RecommendConfig, fits: dict, memory_fit: dict, notes: list[str]) -> dict:
    """The largest batch whose upper-band memory fits the device (a multiple of 8 from 8 up)."""
    confidence = fits["options"]["confidence"]
    swept_params, swept_seq = fits["measured"].get("params"), fits["measured"].get("seq_len")
    param_scale = cfg.params / swept_params if cfg.params else 1.0
    seq_len = cfg.seq_len or int(swept_seq or DEFAULT_SEQ_LEN)
    token_scale = seq_len / swept_seq if swept_seq else 1.0
    budget_mb = cfg.memory_gb * MB_PER_GB * (1 - cfg.memory_headroom)
    cap = int(cfg.max_extrapolation * memory_fit["x_range"][1])
    batches = np.arange(1, cap + 1)
    _, _, upper = predict_band(memory_fit, np.log(batches * token_scale)[:, None], confidence)
    upper_mb = param_scale * np.exp(upper)
    fitting = batches[upper_mb <= budget_mb]
    if len(fitting) == 0:
        raise UserError(f"even batch 1 is predicted to need {upper_mb[0] / MB_PER_GB:.2f} GiB (upper band) > "
                        f"{budget_mb / MB_PER_GB:.2f} GiB usable of --memory-gb {cfg.memory_gb:g}; use a smaller "
                        f"model or --seq_len, gradient checkpointing or ZeRO-2 offload")
    batch = int(fitting.max())
    if batch >= 8:
        batch -= batch % 8  # multiples of 8 suit GPU kernels; costs at most 7 sequences
    limited_by = "extrapolation cap" if upper_mb[cap - 1] <= budget_mb else "memory"
    if limited_by == "extrapolation cap":
        notes.append(f"batch capped at {cfg.max_extrapolation:g} x the largest swept batch; memory would allow more")
    lo_m, hi_m = memory_fit["x_range"]
    if not lo_m <= batch * token_scale <= hi_m:
        notes.append(f"memory extrapolated: {batch * token_scale:g} swept-length sequences per micro batch is "
                     f"outside the swept {lo_m:g}-{hi_m:g}")
    return {"batch_size": batch, "effective_batch_size": batch, "limited_by": limited_by, "seq_len": seq_len,
            "predicted_memory_gb": float(upper_mb[batch - 1]) / MB_PER_GB, "usable_memory_gb": budget_mb / MB_PER_GB,
            "param_scale": param_scale}


def _learning_rate(cfg: RecommendConfig, fits: dict, batch: int, notes: list[str]) -> dict:
    """From the joint fit across sizes when the scan had them (at the target N), else the one-size lr(B) fit."""
    confidence = fits["options"]["confidence"]
    transfer = fits.get("transfer") or {}
    if transfer.get("joint_fit", {}).get("status") == "ok":
        return _lr_across_sizes(cfg, fits, transfer, batch, notes)
    lr_fit = _require(fits, "lr_opt")
    center, low, high = predict_band(lr_fit, np.array([[math.log(batch)]]), confidence)
    lr, lr_low, lr_high = (float(math.exp(v[0])) for v in (center, low, high))
    lo_b, hi_b = lr_fit["x_range"]
    if not lo_b <= batch <= hi_b:
        notes.append(f"lr extrapolated: batch {batch} is outside the swept {lo_b:g}-{hi_b:g}")
    if lr_fit.get("warning"):
        notes.append(lr_fit["warning"])
    if cfg.params:
        notes.append("lr fitted on one model size: it does not follow N; scan several sizes (--sizes) to forecast "
                     "lr for a bigger model -- meanwhile start at the low end")
    return {"learning_rate": lr, "learning_rate_interval": [lr_low, lr_high], "extrapolation": None,
            "lr_basis": f"lr_opt = a * batch^b fit of the swept model at batch {batch}", "confirm_lrs": None}


def _lr_across_sizes(cfg: RecommendConfig, fits: dict, transfer: dict, batch: int, notes: list[str]) -> dict:
    from llmlab.scaling.transfer import UNINFORMATIVE_BAND, band_ratio, forecast

    fit, holdout = transfer["joint_fit"], transfer["holdout"]
    largest = fit["n_range"][1]
    target = float(cfg.params or fits["measured"]["params"] or largest)
    lr, lr_low, lr_high = forecast(fit, target, batch, fits["options"]["confidence"])
    factor = target / largest
    # The held-out check is this lab's only evidence for extrapolating in N: beyond the factor it covered the
    # forecast is unvalidated (published laws have missed by more than 4x far from their data), and so it is
    # everywhere when the check's band was too wide to fail.
    checked = holdout.get("status") == "ok"
    informative = checked and band_ratio(holdout) <= UNINFORMATIVE_BAND
    validated = holdout["extrapolation"] if informative else 1.0
    if factor > validated:
        why = (f" (forecast / measured {holdout['median_ratio']:.2f})" if informative else
               f" (its band spans {band_ratio(holdout):.0f}x, too wide to validate anything)" if checked else
               " (no held-out check ran)")
        notes.append(f"WARNING: target N is {factor:.1f}x the largest scanned size; the held-out check validated "
                     f"{validated:.1f}x{why}: run the confirmation scan before the long job")
    if holdout.get("status") == "ok" and not holdout["all_inside"]:
        notes.append("WARNING: on this scan's held-out size the measured lr_opt fell outside the forecast band")
    if fit.get("warning"):
        notes.append(fit["warning"])
    basis = (f"joint fit ln lr = {fit['k0']:.3f} {fit['alpha']:+.3f} ln N"
             + (f" {fit['beta']:+.3f} ln B" if fit["with_batch"] else "") + f" at N = {target:,.0f}, B = {batch}")
    return {"learning_rate": lr, "learning_rate_interval": [lr_low, lr_high], "extrapolation": factor,
            "lr_basis": basis, "target_params": target,
            "confirm_lrs": [float(f"{lr * m:.3g}") for m in (0.5, 1.0, 2.0)]}


def _schedule(cfg: RecommendConfig, swept_params, batch: int, seq_len: int, notes: list[str]) -> dict:
    if cfg.tokens:
        tokens, basis = cfg.tokens, "--tokens"
    elif cfg.params or swept_params:
        tokens = int(cfg.tokens_per_param * (cfg.params or swept_params))
        basis = f"{cfg.tokens_per_param:g} tokens/param (Chinchilla) x {int(cfg.params or swept_params):,} params"
    else:
        raise UserError("the sweep did not record its model's parameter count, so there is no default token "
                        "budget; pass --tokens D (training tokens)")
    total_steps = max(1, math.ceil(tokens / (batch * seq_len)))
    warmup = max(50, round(0.03 * total_steps * batch / 32))
    if warmup > total_steps // 2:
        warmup = max(1, total_steps // 2)
        notes.append("warmup capped at half of the run (the formula asked for more than the run has)")
    return {"tokens": tokens, "tokens_basis": basis, "max_steps": total_steps, "warmup_steps": warmup}


def confirmation_commands(rec: dict, output: str) -> list[str]:
    """Three short runs around the forecast at the target size: cheap insurance before the long job."""
    if not rec.get("confirm_lrs"):
        return []
    steps = min(rec["max_steps"], max(200, rec["max_steps"] // 10))
    return [f"accelerate launch train_pretrain.py --config {output} --learning_rate {lr:g} --max_steps {steps} "
            f"--output_dir runs/confirm_lr{lr:g}" for lr in rec["confirm_lrs"]]


def config_yaml(rec: dict, cfg: RecommendConfig, output: str = "RECOMMENDED.yaml") -> str:
    """The YAML train_pretrain.py --config reads; every value says where it came from."""
    low, high = rec["learning_rate_interval"]
    learning_rate = float(f"{rec['learning_rate']:.4g}")
    extrapolation = f"; extrapolated {rec['extrapolation']:.1f}x in N" if rec.get("extrapolation") else ""
    values = [
        ("learning_rate", learning_rate, f"{rec['lr_basis']}; {rec['confidence']:.0%} band [{low:.3g}, {high:.3g}]"
                                         f"{extrapolation}"),
        ("effective_batch_size", rec["effective_batch_size"], "= batch_size (no accumulation needed)"),
        ("batch_size", rec["batch_size"], f"largest whose upper-band memory {rec['predicted_memory_gb']:.2f} GiB fits "
                                          f"{rec['usable_memory_gb']:.2f} GiB usable (limited by {rec['limited_by']})"),
        ("warmup_steps", rec["warmup_steps"], "max(50, 0.03 x max_steps x batch / 32)"),
        ("max_steps", rec["max_steps"], f"{rec['tokens']:,} tokens ({rec['tokens_basis']}) / (batch x block_size)"),
        ("block_size", rec["seq_len"], "the memory prediction and max_steps hold for this sequence length"),
        ("min_lr", float(f"{learning_rate / 10:.4g}"), "cosine floor lr/10 (nanoGPT, Chinchilla)"),
    ]
    if rec["clip"] is not None:
        values.append(("clip", rec["clip"], rec["clip_basis"]))
    lines = [f"# Recommended by `sweep.py recommend --from {cfg.from_dir} --memory-gb {cfg.memory_gb:g}`"]
    lines += [f"# note: {n}" for n in rec["notes"]]
    commands = confirmation_commands(rec, output)
    if commands:
        lines += ["# confirm the lr first: three short runs at the target size, keep the lowest validation loss"]
        lines += [f"#   {c}" for c in commands]
    lines += [f"{key}: {yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"
              f"  # {basis}" for key, value, basis in values]
    return "\n".join(lines) + "\n"


def summary_table(rec: dict) -> str:
    low, high = rec["learning_rate_interval"]
    rows = [
        ("batch_size", str(rec["batch_size"]), f"largest batch (a multiple of 8 from 8 up) whose upper-band memory fits "
         f"({rec['predicted_memory_gb']:.2f} of {rec['usable_memory_gb']:.2f} GiB); limited by {rec['limited_by']}"),
        ("effective_batch_size", str(rec["effective_batch_size"]), "= batch_size (no accumulation needed)"),
        ("learning_rate", f"{rec['learning_rate']:.3g}", f"{rec['lr_basis']}, {rec['confidence']:.0%} interval "
         f"[{low:.3g}, {high:.3g}]" + (f"; {rec['extrapolation']:.1f}x the largest scanned N"
                                       if rec.get("extrapolation") else "")),
        ("max_steps", str(rec["max_steps"]), f"{rec['tokens']:,} tokens / (batch x {rec['seq_len']})"),
        ("warmup_steps", str(rec["warmup_steps"]), "max(50, 0.03 x max_steps x batch / 32)"),
        ("clip", "-" if rec["clip"] is None else f"{rec['clip']:.4g}", rec["clip_basis"] or "not measured"),
    ]
    if rec["expected_early_loss_std"]:
        center, low_std, high_std = rec["expected_early_loss_std"]
        rows.append(("(early loss std)", f"{center:.3g}", f"expected from the loss_std fit at this lr and batch "
                     f"(swept model), interval [{low_std:.3g}, {high_std:.3g}]; not written to the YAML"))
    width = max(len(r[0]) for r in rows)
    value_width = max(len(r[1]) for r in rows)
    lines = [f"{'option':<{width}}  {'value':<{value_width}}  basis", "-" * (width + value_width + 60)]
    lines += [f"{name:<{width}}  {value:<{value_width}}  {basis}" for name, value, basis in rows]
    lines += [f"note: {n}" for n in rec["notes"]]
    return "\n".join(lines)


def recommend_main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="sweep.py recommend", description=__doc__.split("\n")[0])
    add_dataclass_args(parser, RecommendConfig)
    parser.add_argument("--from", dest="from_dir", default=argparse.SUPPRESS, help="same as --from_dir")
    parser.add_argument("--memory-gb", dest="memory_gb", default=argparse.SUPPRESS, help="same as --memory_gb")
    namespace = parser.parse_args(argv)
    cfg = config_from_namespace(RecommendConfig, namespace)
    given = set(vars(namespace)) | set(load_yaml(namespace.config) if namespace.config else {})
    rec = recommend(cfg, reanalyse=tuple(name for name in ANALYSIS_OPTIONS if name in given))
    output = Path(cfg.output) if cfg.output else Path(cfg.from_dir) / "recommended_config.yaml"
    atomic_write_text(output, config_yaml(rec, cfg, str(output)))
    print(summary_table(rec))
    commands = confirmation_commands(rec, str(output))
    if commands:
        print("before the long run, confirm the lr at the target size (keep the lowest validation loss):")
        print("\n".join(f"  {c}" for c in commands))
    print(f"wrote {output}  (use: accelerate launch train_pretrain.py --config {output})")
    return rec
