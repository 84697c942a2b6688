"""`sweep.py recommend`: turn an lr scan's measurements into a complete train_pretrain.py config for one GPU.

- Learning rate: across sizes, the law's forecast at the target N with its prediction interval, and the
  extrapolation its held-out verdict validated (`undecided` and `failed` validate nothing: a WARNING beyond 1x);
  from a one-size scan, its lr(batch) fit. Three confirmation runs (0.5x, 1x, 2x) are printed either way.
- Batch: the effective batch (given, or DeepSeek LLM's B_opt = 0.292 C^0.3271 tokens at C = 6 N D), reached with
  the largest micro batch the analytic memory model (llmlab.scaling.memory) fits on --memory-gb, plus gradient
  accumulation.
- Optimizer and schedule: the best level a doe20 (--doe) resolved against its reference, else the defaults; warmup,
  clip (1.5 x the measured mean grad norm) and label smoothing. The YAML says where every value came from.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import yaml
from scipy import stats

import llmlab.scaling.memory as memory
from llmlab.core.config import Parser, add_dataclass_args, config_from_namespace, load_yaml, opt
from llmlab.core.errors import UserError
from llmlab.core.io import atomic_write_text
from llmlab.models.gpt2 import GPT2_PRESETS
from llmlab.scaling.fits import ScalingOptions, predict_band
from llmlab.scaling.law import predict
from llmlab.scaling.length import combine, length_shift
from llmlab.scaling.report import FITS_FILE, write_lr_bs_report
from llmlab.scaling.transfer import flat_forecast
from llmlab.sweep import report
from llmlab.train.components import OPTIMIZERS

MAX_CONTEXT = 1024  # the GPT-2 family train_pretrain.py builds has 1024 positions
MAX_PARAMS = 1e13
MAX_STEPS = 10**9


@dataclass
class RecommendConfig(ScalingOptions):
    """Recommendation options; the inherited analysis options (thresholds, bootstrap) re-analyse the stored
    trials, and rewrite the sweep's scaling_fits.json / report / plots, when they differ from the stored ones."""

    from_dir: str = opt("", "output folder of `sweep.py --grid lr_bs` (holds scaling_fits.json); also --from")
    memory_gb: Optional[float] = opt(None, "memory of the target GPU in GiB (required); also --memory-gb")
    params: Optional[int] = opt(
        None,
        "non-embedding parameter count N of the target model (12 x layers x width^2 "
        "for GPT-2); unset = the swept model",
    )
    n_layer: Optional[int] = opt(None, "target layers (unset: from --params at GPT-2 small's width = 64 x layers)")
    n_embd: Optional[int] = opt(None, "target width (unset: from --params and --n_layer)")
    tokens: Optional[int] = opt(None, "training tokens of the target run (unset = tokens_per_param x params)")
    tokens_per_param: float = opt(20.0, "tokens per parameter when --tokens is not given (Chinchilla)")
    seq_len: int = opt(1024, "sequence length (block_size) of the target run, at most 1024 (GPT-2 positions)")
    effective_batch_size: Optional[int] = opt(
        None, "sequences per optimizer step (unset: DeepSeek LLM's B_opt at the target's compute)"
    )
    precision: Literal["bf16", "fp16", "no"] = opt("bf16", "training precision on the target GPU")
    zero_stage: int = opt(0, "0: plain accelerate; 2: DeepSpeed ZeRO-2")
    offload: bool = opt(False, "ZeRO-2 with the optimizer states and step on the CPU (one_gpu_zero2_offload.yaml)")
    gradient_checkpointing: bool = opt(False, "plan with activation recomputation (less memory, ~30 %% slower)")
    optimizer: Optional[str] = opt(
        None, "a registered optimizer (unset: the best the --doe sweep resolved, else adamw)", choices=OPTIMIZERS
    )
    doe: Optional[str] = opt(
        None,
        "a doe20 / YAML-grid sweep folder whose resolved contrasts pick the optimizer and "
        "schedule (unset: the defaults)",
    )
    parametrization: Optional[Literal["standard", "mup"]] = opt(
        None,
        "the target's parametrization; unset = the scan's (its probes' lr holds only under the parametrization "
        "they trained with: another is refused)",
    )
    across_architectures: bool = opt(
        False,
        "carry a law measured on another architecture (the lab's minimal Transformer) into the GPT-2 this "
        "configures, printed as an extrapolation (refused without it)",
    )
    length_from: Optional[str] = opt(
        None,
        "a length scan's folder (its scaling_fits.json holds the law ln lr = a + beta ln D): moves the lr from the "
        "scan's training tokens to the target's, with its prediction interval (unset: the lr stays at the scan's "
        "length, with a WARNING)",
    )
    output: Optional[str] = opt(None, "YAML file to write; unset = FROM/recommended_config.yaml")
    memory_headroom: float = opt(0.10, "fraction of --memory-gb kept free on top of the prediction")

    def validate(self) -> None:
        super().validate()
        if not self.from_dir:
            raise UserError("--from is required: pass the output folder of `python sweep.py --grid lr_bs`")
        if self.memory_gb is None or not (math.isfinite(self.memory_gb) and self.memory_gb > 0):
            raise UserError("--memory-gb is required and must be > 0 (the target GPU's memory in GiB)")
        for name in ("params", "tokens", "n_layer", "n_embd", "effective_batch_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UserError(f"--{name} must be > 0, got {value}")
        if self.params is not None and self.params > MAX_PARAMS:
            raise UserError(
                f"--params {self.params:.3g} is beyond any model this trainer builds (max {MAX_PARAMS:.0e})"
            )
        if not 1 <= self.seq_len <= MAX_CONTEXT:
            raise UserError(f"--seq_len must be in [1, {MAX_CONTEXT}] (GPT-2's positions), got {self.seq_len}")
        if self.n_embd is not None and self.n_embd % 64:
            raise UserError(f"--n_embd must be a multiple of 64 (GPT-2's head size), got {self.n_embd}")
        if not 0 <= self.memory_headroom < 1 or not (
            math.isfinite(self.tokens_per_param) and self.tokens_per_param > 0
        ):
            raise UserError("--memory_headroom must be in [0, 1) and --tokens_per_param > 0")
        if self.zero_stage not in (0, 2):
            raise UserError(f"--zero_stage must be 0 or 2 (the configs this project ships), got {self.zero_stage}")
        if self.offload and self.zero_stage != 2:
            raise UserError("--offload needs --zero_stage 2 (CPU offload is a DeepSpeed ZeRO feature)")
        if self.output and Path(self.output).is_dir():
            raise UserError(
                f"--output {self.output} is a folder; give a file name, e.g. {self.output}/recommended.yaml"
            )


def load_fits(from_dir: str, option: str = "--from") -> dict:
    folder = Path(from_dir)
    if not folder.is_dir():
        raise UserError(f"{option} {folder}: folder not found; pass the output folder of `sweep.py --grid lr_bs`")
    path = folder / FITS_FILE
    if not path.is_file():
        raise UserError(
            f"{option} {folder}: no {FITS_FILE} (no finished lr_bs sweep there); run "
            f"`python sweep.py --grid lr_bs --output_dir {folder}` first (rerunning a finished sweep "
            f"with its original flags skips its trials and only rewrites the reports)"
        )
    try:
        fits = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({err}); rerun the lr_bs sweep to rewrite it") from None
    if not isinstance(fits, dict) or not {"fits", "trials", "options", "measured"} <= set(fits):
        raise UserError(
            f"{path} is not a scaling analysis (wrong shape); rerun the lr_bs sweep with --report_only to rewrite it"
        )
    return fits


ANALYSIS_OPTIONS = tuple(f.name for f in fields(ScalingOptions))


def recommend(cfg: RecommendConfig, reanalyse: tuple[str, ...] = ()) -> dict:
    """`reanalyse` names the analysis options the user set; the stored analysis keeps all the others."""
    fits = load_fits(cfg.from_dir)
    stored = {k: v for k, v in fits.get("options", {}).items() if k in ANALYSIS_OPTIONS}
    options = ScalingOptions(**{**stored, **{name: getattr(cfg, name) for name in reanalyse}})
    if reanalyse and vars(options) != fits.get("options"):
        print(
            f"re-analysing the {fits['n_trials']} stored trials with the given analysis options "
            f"(rewrites {FITS_FILE}, the scaling report and plots)"
        )
        write_lr_bs_report(cfg.from_dir, fits["trials"], options)
        fits = load_fits(cfg.from_dir)
    params = float(cfg.params or fits["measured"].get("non_embedding") or fits["measured"].get("params") or 0)
    if not params:
        raise UserError("the sweep did not record its model's size; pass --params N (non-embedding parameters)")
    notes: list[str] = []
    probe = probe_of(cfg.from_dir, fits)
    parametrization = _parametrization(cfg, probe, notes)
    shape = memory.shape_for(params, cfg.seq_len, cfg.n_layer, cfg.n_embd)
    tokens = int(cfg.tokens or cfg.tokens_per_param * shape.non_embedding)
    methods = _methods(cfg, notes)
    plan = {"shape": shape, "tokens": tokens, "gradient_checkpointing": cfg.gradient_checkpointing, **methods}
    plan.update(parametrization)
    plan.update(_batch_plan(cfg, shape, tokens, methods["optimizer"], fits, notes))
    step_tokens = plan["effective_batch_size"] * cfg.seq_len
    plan.update(_learning_rate(cfg, fits, shape.non_embedding, step_tokens, notes, plan["parametrization"] == "mup"))
    if cfg.length_from:
        plan.update(_at_length(cfg, probe, plan, fits["options"]["confidence"], notes))
    plan.update(_schedule(tokens, plan["effective_batch_size"], cfg.seq_len, notes))
    plan.update(_clip(fits, plan["learning_rate"], notes))
    plan["extrapolations"] = extrapolations(probe, plan, cfg.seq_len)
    depth = next(row for row in plan["extrapolations"] if row["quantity"] == "depth (layers)")
    if depth["factor"] != 1 and depth["scanned"]:
        notes.append(
            f"WARNING: the target has {shape.n_layer} layers and the probes {depth['scanned'][-1]:.0f}: the lr was "
            "measured across width at the probes' depth (muP's claim is about width only); scan probes at the "
            "target's depth, or let the confirmation runs decide"
        )
    length = next(row for row in plan["extrapolations"] if row["quantity"] == "training tokens")
    if length["factor"] > 1 and length["scanned"] and not cfg.length_from:
        notes.append(
            f"WARNING: the target trains {tokens:,} tokens, {length['factor']:,.0f}x the scan's longest trials "
            f"({length['scanned'][-1]:,.0f}); how the optimal lr moves with training length is not measured here: "
            "the confirmation runs bracket it"
        )
    return {**plan, "probe": probe, "confidence": fits["options"]["confidence"], "notes": notes}


def probe_of(from_dir: str, fits: dict) -> dict:
    """What the scan's probes were: model, parametrization (and muP's base width), and the ranges its trials covered
    (N, depth, tokens per step, training tokens), from the scan's config.yaml and its trials."""
    try:
        sweep = load_yaml(str(Path(from_dir) / "config.yaml"))
    except UserError:
        sweep = {}
    models = fits["measured"].get("models") or []
    model = sweep.get("model") or (models[0] if len(models) == 1 else None)
    feasible = set(fits.get("feasible_ids") or [])
    trials = [t for t in fits.get("trials") or [] if t.get("trial_id") in feasible]

    def values(key, of=lambda t, key: t.get(key)):
        found = [of(t, key) for t in trials]
        return sorted({float(v) for v in found if isinstance(v, (int, float)) and math.isfinite(v)})

    step_tokens = lambda t, _: t["batch_size"] * t["seq_len"] if t.get("seq_len") and t.get("batch_size") else None  # noqa: E731
    return {
        "model": model,
        "family": "minimal" if model == "minimal" else ("gpt2" if model in GPT2_PRESETS else None),
        "parametrization": sweep.get("parametrization", "standard"),
        "mup_base_width": sweep.get("mup_base_width"),
        "n_params": values("n_params"),
        "depths": values("model_depth", lambda t, key: t.get(key) or _depth_of(t.get("size"))),
        "tokens_per_step": values("", step_tokens),
        "train_tokens": values("train_tokens"),
    }


def _depth_of(size) -> Optional[int]:
    """The depth of a WIDTHxDEPTH size label (a row that did not record model_depth)."""
    parts = str(size or "").split("x")
    return int(parts[1]) if len(parts) == 2 and parts[1].isdigit() else None


def _parametrization(cfg: RecommendConfig, probe: dict, notes: list[str]) -> dict:
    """The target trains under the probes' parametrization (and muP's base width); anything else is refused, and
    another architecture only with --across_architectures."""
    scanned = probe["parametrization"]
    if cfg.parametrization and cfg.parametrization != scanned:
        raise UserError(
            f"{cfg.from_dir} measured the lr of {scanned}-parametrised probes; under {cfg.parametrization} the "
            f"optimum moves differently with size (the lab's standard scans: falling with N), so that lr would "
            f"not hold: drop --parametrization, or scan {cfg.parametrization} probes"
        )
    if probe["family"] == "minimal" and not cfg.across_architectures:
        raise UserError(
            f"{cfg.from_dir} scanned the lab's minimal Transformer (RoPE, no biases, feed-forward 2x) and this "
            "configures GPT-2: scan GPT-2 probes (sweep.py --grid lr_bs --model gpt2), or pass "
            "--across_architectures to carry the law over as an extrapolation"
        )
    if probe["family"] == "minimal":
        notes.append(
            "EXTRAPOLATION: the lr law was measured on the lab's minimal Transformer and is carried into GPT-2 "
            "(--across_architectures); nothing validated that step"
        )
    if scanned != "mup":
        return {"parametrization": "standard", "mup_base_width": None}
    return {"parametrization": "mup", "mup_base_width": int(probe["mup_base_width"] or 128)}


def extrapolations(probe: dict, plan: dict, seq_len: int) -> list[dict]:
    """Each way the target lies beyond what the scan measured, beside what its verdicts validated: only the held-out
    verdict validates anything (a factor in N); depth, tokens per step and training tokens are validated only inside
    the scanned values."""
    shape = plan["shape"]
    validated_n = plan.get("validated_extrapolation") or 1.0
    rows = [
        ("N (non-embedding)", probe["n_params"], shape.non_embedding),
        ("depth (layers)", probe["depths"], shape.n_layer),
        ("tokens per step", probe["tokens_per_step"], plan["effective_batch_size"] * seq_len),
        ("training tokens", plan.get("length_range") or probe["train_tokens"], plan["tokens"]),
    ]
    out = []
    for name, scanned, target in rows:
        factor = 1.0
        if scanned and target > scanned[-1]:
            factor = target / scanned[-1]
        elif scanned and target < scanned[0]:
            factor = target / scanned[0]
        if name.startswith("N"):
            validated = f"{validated_n:.1f}x past the largest (held-out verdict)" if validated_n > 1 else "none"
        elif name.startswith("training") and plan.get("length_range"):
            validated = "the length law's fit lengths (beta carries the lr between them)"
        else:
            validated = "none beyond the scanned values" + (" (no length scan)" if name.startswith("training") else "")
        out.append({"quantity": name, "scanned": scanned, "target": target, "factor": factor, "validated": validated})
    return out


def extrapolation_lines(rec: dict) -> list[str]:
    """The extrapolation table as text lines (the summary prints them, the YAML keeps them as comments)."""
    lines = [f"{'extrapolation':<20}{'scanned':>24}{'target':>16}{'factor':>11}  validated"]
    for row in rec["extrapolations"]:
        scanned = row["scanned"]
        span = (
            "not recorded"
            if not scanned
            else (f"{scanned[0]:,.0f}" if len(scanned) == 1 else f"{scanned[0]:,.0f}-{scanned[-1]:,.0f}")
        )
        factor = f"{row['factor']:,.0f}" if row["factor"] >= 100 else f"{row['factor']:.3g}"
        lines.append(f"{row['quantity']:<20}{span:>24}{row['target']:>16,.0f}{factor:>10}x  {row['validated']}")
    return lines


def _methods(cfg: RecommendConfig, notes: list[str]) -> dict:
    """Optimizer, schedule and label smoothing: a doe20's resolved improvement over its reference, else defaults."""
    chosen = {
        "optimizer": ("adamw", "default (AdamW)"),
        "lr_scheduler": ("cosine", "default (cosine to min_lr)"),
        "label_smoothing": (0.0, "default (none)"),
    }
    if cfg.doe:
        for factor, (level, why) in resolved_improvements(cfg.doe).items():
            key = "lr_scheduler" if factor == "scheduler" else factor
            if key in chosen:
                chosen[key] = (float(level) if key == "label_smoothing" else level, why)
        for key, (level, why) in chosen.items():
            if why.startswith("default"):
                chosen[key] = (level, f"default: {cfg.doe} resolved no level better than the reference (Holm)")
    if cfg.optimizer:
        chosen["optimizer"] = (cfg.optimizer, "--optimizer")
    return {key: value for key, (value, _) in chosen.items()} | {"basis": {k: why for k, (_, why) in chosen.items()}}


def resolved_improvements(folder: str) -> dict[str, tuple[str, str]]:
    """factor -> (level, why) for every level whose contrast against the reference lowered the final loss and is
    resolved after Holm, in a finished doe20 / grid sweep folder (its results.csv and design.json)."""
    path = Path(folder)
    try:
        design = json.loads((path / "design.json").read_text())
        with open(path / "results.csv", newline="") as f:
            rows = [
                {k: (float(v) if k == "final_loss" and v not in ("", "None") else v) for k, v in r.items()}
                for r in csv.DictReader(f)
            ]
    except (OSError, ValueError) as err:
        raise UserError(
            f"--doe {folder}: not a finished sweep folder ({str(err).splitlines()[0][:120]}); pass the "
            "output folder of `sweep.py --grid doe20`"
        ) from None
    best: dict[str, tuple[float, str, str]] = {}
    for c in report.effects(rows, design)["contrasts"]:
        if c["verdict"] == "resolved" and c["effect"] < 0 and c["effect"] < best.get(c["factor"], (0.0,))[0]:
            best[c["factor"]] = (
                c["effect"],
                c["level"],
                f"{folder}: {c['level']} - {c['reference']} = {c['effect']:+.3f} nats, Holm p = {c['p_holm']:.2g}",
            )
    return {factor: (level, why) for factor, (_, level, why) in best.items()}


def _batch_plan(
    cfg: RecommendConfig, shape: memory.Shape, tokens: int, optimizer: str, fits: dict, notes: list[str]
) -> dict:
    """The effective batch, and the largest micro batch the memory model fits under it (then accumulation)."""
    if cfg.effective_batch_size:
        effective, basis = cfg.effective_batch_size, "--effective_batch_size"
    else:
        b_tokens = 0.2920 * (6 * shape.non_embedding * tokens) ** 0.3271
        effective = max(1, round(b_tokens / cfg.seq_len))
        basis = f"DeepSeek LLM (2024) B_opt = 0.292 C^0.3271 = {b_tokens:,.0f} tokens at C = 6 N D"
    factor, calibration = memory.calibrate(fits.get("trials") or [])
    usable = cfg.memory_gb * memory.GIB * (1 - cfg.memory_headroom)
    plan = dict(
        optimizer=optimizer,
        precision=cfg.precision,
        zero_stage=cfg.zero_stage,
        offload=cfg.offload,
        gradient_checkpointing=cfg.gradient_checkpointing,
        calibration=factor,
    )
    need = lambda micro: memory.predicted_bytes(shape, micro, **plan)  # noqa: E731
    if need(1)["total"] > usable:
        parts = need(1)
        fix = (
            "use ZeRO-2 with CPU offload (--zero_stage 2 --offload), gradient checkpointing, a smaller model or "
            "a larger GPU"
            if not cfg.offload
            else "use a smaller model or a larger GPU"
        )
        raise UserError(
            f"even micro batch 1 needs {parts['total'] / memory.GIB:.1f} GiB (model states "
            f"{parts['states'] / memory.GIB:.1f} GiB for {shape.total:,} parameters with {optimizer}) > "
            f"{usable / memory.GIB:.1f} GiB usable of --memory-gb {cfg.memory_gb:g}; {fix}"
        )
    micro = 1
    while micro < effective and need(micro + 1)["total"] <= usable:
        micro += 1
    if micro >= 8:
        micro -= micro % 8  # multiples of 8 suit GPU kernels; costs at most 7 sequences
    accumulation = math.ceil(effective / micro)
    parts = need(micro)
    notes.append(f"memory model {calibration}")
    return {
        "batch_size": micro,
        "effective_batch_size": micro * accumulation,
        "accumulation": accumulation,
        "batch_basis": basis,
        "predicted_memory_gb": parts["total"] / memory.GIB,
        "usable_memory_gb": usable / memory.GIB,
        "memory_parts": {k: v / memory.GIB for k, v in parts.items() if k != "calibration"},
    }


def _learning_rate(
    cfg: RecommendConfig, fits: dict, params: float, batch_tokens: float, notes: list[str], mup: bool = False
) -> dict:
    """Under muP, its flat forecast across the scanned widths; else the law across sizes when the scan had them (at
    the target N); else the one-size lr(B) fit."""
    transfer = fits.get("transfer") or {}
    if mup and sum(p["status"] == "measured" for p in transfer.get("points") or []) >= 2:
        return _lr_flat(transfer, params, fits["options"]["confidence"], notes)
    if (transfer.get("law") or {}).get("status") == "ok":
        return _lr_across_sizes(fits, transfer, params, batch_tokens, notes)
    lr_fit = fits["fits"].get("lr_opt", {})
    if lr_fit.get("status") != "ok":
        raise UserError(
            f"no learning-rate fit in {cfg.from_dir}: {lr_fit.get('reason', 'missing')}; scan several "
            "sizes (--sizes default) or >= 3 batch sizes"
        )
    seq = fits["measured"].get("seq_len") or cfg.seq_len
    batch = batch_tokens / seq  # the swept model's batch in its own sequences, at the same tokens per step
    center, low, high = predict_band(lr_fit, np.array([[math.log(batch)]]), fits["options"]["confidence"])
    lo_b, hi_b = lr_fit["x_range"]
    if not lo_b <= batch <= hi_b:
        notes.append(
            f"lr extrapolated: {batch:,.0f} swept-length sequences per step is outside the swept {lo_b:g}-{hi_b:g}"
        )
    if cfg.params:
        notes.append(
            "WARNING: lr fitted on one model size does not follow N; scan several sizes (--sizes default) to "
            "forecast it for a bigger model, and run the confirmation runs"
        )
    lr = float(math.exp(center[0]))
    return {
        "learning_rate": lr,
        "learning_rate_interval": [float(math.exp(low[0])), float(math.exp(high[0]))],
        "lr_se_ln": float(high[0] - low[0]) / (2 * stats.norm.ppf((1 + fits["options"]["confidence"]) / 2)),
        "lr_df": None,
        "extrapolation": None,
        "lr_basis": f"lr_opt = a * batch^b fit of the swept model at batch {batch:.3g}",
        "confirm_lrs": [float(f"{lr * m:.3g}") for m in (0.5, 1.0, 2.0)],
    }


def _lr_flat(transfer: dict, params: float, confidence: float, notes: list[str]) -> dict:
    """muP's prediction: the lr optimum does not move with width (the lab's decided result: within 1.5x at 416x4), so
    the target's lr is the scanned widths' mean lr_opt, with the prediction interval of one more width (the widths'
    scatter about their mean, on their df). Only the scan's own flat held-out verdict validates going past it."""
    flat = flat_forecast(transfer["points"])  # the estimator of the registered flat forecast
    centre, df, n = flat["ln_lr"], flat["df"], len(flat["sizes"])
    se_pred = flat["se_mean"] * math.sqrt(n + 1)  # one more width: s sqrt(1 + 1/n), with se_mean = s / sqrt(n)
    half = float(stats.t.ppf((1 + confidence) / 2, df)) * se_pred
    largest = max(p["n_params"] for p in transfer["points"] if p["status"] == "measured")
    holdout = transfer.get("holdout") or {}
    verdicts = [r["flat"] for r in holdout.get("rows") or [] if isinstance(r.get("flat"), dict)]
    verdict = verdicts[0]["verdict"] if len(verdicts) == 1 else None
    validated = holdout["extrapolation"] if verdict and verdict.startswith("within") else 1.0
    factor = params / largest
    if factor > validated:
        why = f"its flat held-out verdict: {verdict}" if verdict else "no flat held-out verdict in this scan"
        notes.append(
            f"WARNING: target N is {factor:.1f}x the largest scanned width's and "
            + (f"the held-out check validated {validated:.1f}x only" if validated > 1 else "nothing here validated it")
            + f" ({why}); muP's flat lr held within 1.5x at 416x4 on the minimal Transformer (docs/findings): run "
            "the confirmation runs before the long job"
        )
    lr = math.exp(centre)
    return {
        "learning_rate": lr,
        "learning_rate_interval": [math.exp(centre - half), math.exp(centre + half)],
        "lr_se_ln": se_pred,
        "lr_df": df,
        "extrapolation": factor,
        "validated_extrapolation": validated,
        "heldout_verdict": verdict,
        "lr_basis": f"muP's flat lr: the mean lr_opt of {', '.join(flat['sizes'])}; {confidence:.0%} "
        f"prediction interval of one more width on {df} df",
        "confirm_lrs": [float(f"{lr * m:.3g}") for m in (0.5, 1.0, 2.0)],
    }


def _lr_across_sizes(fits: dict, transfer: dict, params: float, batch_tokens: float, notes: list[str]) -> dict:
    """The law's forecast at the target N with its prediction interval, and the extrapolation it was validated for."""
    law, holdout = transfer["law"], transfer["holdout"]
    largest = law["n_range"][1]
    scanned = [p for p in transfer["points"] if p["status"] == "measured"]
    batch = max(p["batch_size"] for p in scanned)
    forecast = predict(law, params, batch, fits["options"]["confidence"])
    factor = params / largest
    # The held-out verdict is this lab's only evidence for extrapolating in N: only `within 1.5x` validates the
    # factor it covered; `undecided` and `failed` validate nothing (published laws miss by > 4x far from their data).
    verdict = holdout.get("verdict") if holdout.get("status") == "ok" else None
    validated = holdout["extrapolation"] if verdict and verdict.startswith("within") else 1.0
    if factor > validated:
        why = {
            None: f"no held-out check ran: {holdout.get('reason', 'the scan has one size')}",
            "failed": "the held-out forecast failed",
            "undecided": "the held-out check was undecided",
        }.get(verdict, f"held-out verdict: {verdict}")
        covered = (
            f"the held-out check validated {validated:.1f}x only"
            if validated > 1
            else "nothing validated an extrapolation in N"
        )
        notes.append(
            f"WARNING: target N is {factor:.1f}x the largest scanned size and {covered} ({why}): run the "
            "confirmation runs before the long job"
        )
    if verdict == "failed":
        notes.append(
            f"WARNING: the law failed its held-out check (worst forecast / measured "
            f"{holdout['worst_ratio']:.2f}): treat this lr as a starting point only"
        )
    seq = fits["measured"].get("seq_len") or 128
    if not law["with_batch"] and abs(math.log(batch_tokens / (batch * seq))) >= math.log(2):
        notes.append(
            f"the scan measured lr_opt at {batch * seq:,.0f} tokens per step only; at {batch_tokens:,.0f} "
            "the optimum may be higher (Adam: about sqrt of the batch ratio, Malladi et al. 2022), which "
            "the confirmation runs bracket"
        )
    basis = (
        f"law ln lr = {law['k0']:.3f} {law['alpha']:+.3f} ln N"
        + (f" {law['beta']:+.3f} ln B" if law["with_batch"] else "")
        + f" at N = {params:,.0f}; {forecast['confidence']:.0%} prediction interval on {law['df']} df"
    )
    return {
        "learning_rate": forecast["lr"],
        "learning_rate_interval": forecast["pi"],
        "lr_se_ln": forecast["se_pred"],
        "lr_df": forecast["df"],
        "extrapolation": factor,
        "validated_extrapolation": validated,
        "heldout_verdict": verdict,
        "lr_basis": basis,
        "confirm_lrs": [float(f"{forecast['lr'] * m:.3g}") for m in (0.5, 1.0, 2.0)],
    }


def _at_length(cfg: RecommendConfig, probe: dict, plan: dict, confidence: float, notes: list[str]) -> dict:
    """The lr moved from the width scan's training tokens to the target's by the length law's beta, the interval
    combining both (llmlab.scaling.length); a target beyond the law's fit lengths is named with a WARNING."""
    fits = load_fits(cfg.length_from, "--length_from")
    law = fits.get("length") or {"status": "missing", "reason": f"{cfg.length_from} holds no length law"}
    other = probe_of(cfg.length_from, fits)
    if (other["family"], other["parametrization"]) != (probe["family"], probe["parametrization"]):
        raise UserError(
            f"--length_from {cfg.length_from} scanned {other['parametrization']} {other['family']} probes and "
            f"--from {probe['parametrization']} {probe['family']} ones: a length law carries only within one "
            "architecture and parametrization"
        )
    d0 = probe["train_tokens"][-1]
    shift = length_shift(law, d0, plan["tokens"])
    moved = combine(math.log(plan["learning_rate"]), plan["lr_se_ln"], plan["lr_df"], shift, confidence)
    low, high = law["d_range"]
    notes.append(
        f"lr moved from the scan's {d0:,.0f} training tokens to {plan['tokens']:,}: x{shift['factor']:.3g} "
        f"(beta {law['beta']:+.3f} [{law['beta_ci'][0]:+.3f}, {law['beta_ci'][1]:+.3f}], {law['df']} df)"
    )
    if not low <= plan["tokens"] <= high:
        notes.append(
            f"WARNING: the target trains {plan['tokens']:,} tokens, outside the length law's measured "
            f"{low:,.0f}-{high:,.0f}: beta is extrapolated {max(plan['tokens'] / high, low / plan['tokens']):,.0f}x; "
            "the confirmation runs bracket it"
        )
    lr = moved["lr"]
    return {
        "learning_rate": lr,
        "learning_rate_interval": moved["interval"],
        "length_shift": shift["factor"],
        "length_range": [low, high],
        "lr_basis": plan["lr_basis"] + f"; moved by the length law's beta {law['beta']:+.3f} to the target's tokens",
        "confirm_lrs": [float(f"{lr * m:.3g}") for m in (0.5, 1.0, 2.0)],
    }


def _schedule(tokens: int, batch: int, seq_len: int, notes: list[str]) -> dict:
    total_steps = math.ceil(tokens / (batch * seq_len))
    if total_steps > MAX_STEPS:
        raise UserError(f"{tokens:,} tokens at {batch} x {seq_len} per step is {total_steps:.3g} steps; lower --tokens")
    if total_steps < 10:
        raise UserError(
            f"--tokens {tokens:,} is only {total_steps} optimizer step(s) of {batch} x {seq_len} tokens; "
            "give at least 10 steps of tokens"
        )
    warmup = max(50, round(0.03 * total_steps * batch / 32))
    if warmup > total_steps // 2:
        warmup = max(1, total_steps // 2)
        notes.append("warmup capped at half of the run (the formula asked for more than the run has)")
    return {"max_steps": total_steps, "warmup_steps": warmup}


def _clip(fits: dict, lr: float, notes: list[str]) -> dict:
    """1.5 x the mean grad norm of the feasible trial nearest in lr (log space), else the trainer's 1.0."""
    trials = {t.get("trial_id"): t for t in fits["trials"]}
    candidates = [
        trials[i]
        for i in fits["feasible_ids"]
        if isinstance(trials[i].get("grad_norm_mean"), (int, float))
        and math.isfinite(trials[i]["grad_norm_mean"])
        and trials[i]["grad_norm_mean"] > 0
    ]
    if not candidates:
        notes.append("no grad norms recorded: clip left at the trainer's default 1.0")
        return {"clip": 1.0, "clip_basis": "trainer default"}
    nearest = min(candidates, key=lambda t: math.log(float(t["lr"]) / lr) ** 2)
    return {
        "clip": round(1.5 * float(nearest["grad_norm_mean"]), 4),
        "clip_basis": f"1.5 x mean grad norm {float(nearest['grad_norm_mean']):.4g} of trial {nearest['trial_id']}",
    }


def confirmation_commands(rec: dict, output: str) -> list[str]:
    """Three short runs around the forecast at the target size: cheap insurance before the long job."""
    steps = min(rec["max_steps"], max(200, rec["max_steps"] // 10))
    return [
        f"accelerate launch train_pretrain.py --config {output} --learning_rate {lr:g} --max_steps {steps} "
        f"--output_dir runs/confirm_lr{lr:g}"
        for lr in rec["confirm_lrs"]
    ]


def yaml_values(rec: dict) -> list[tuple[str, object, str]]:
    low, high = rec["learning_rate_interval"]
    lr = float(f"{rec['learning_rate']:.4g}")
    extrapolation = f"; {rec['extrapolation']:.1f}x the largest scanned N" if rec.get("extrapolation") else ""
    shape = rec["shape"]
    return [
        ("model", "gpt2", "GPT-2 family, reshaped below"),
        (
            "parametrization",
            rec["parametrization"],
            f"the scan's probes' ({rec['probe']['model'] or 'model not recorded'}); the lr holds under it only",
        ),
        *(
            [("mup_base_width", rec["mup_base_width"], "the scan's muP base width: its lr is at this width")]
            if rec["parametrization"] == "mup"
            else []
        ),
        ("optimizer", rec["optimizer"], rec["basis"]["optimizer"]),
        ("lr_scheduler", rec["lr_scheduler"], rec["basis"]["lr_scheduler"]),
        ("n_layer", shape.n_layer, f"N = 12 x layers x width^2 = {shape.non_embedding:,}"),
        ("n_embd", shape.n_embd, "width"),
        ("n_head", shape.n_embd // 64, "heads of 64"),
        ("block_size", shape.seq_len, "the memory plan and max_steps hold for this sequence length"),
        ("learning_rate", lr, f"{rec['lr_basis']}: [{low:.3g}, {high:.3g}]{extrapolation}"),
        ("min_lr", float(f"{lr / 10:.4g}"), "cosine floor lr / 10 (nanoGPT, Chinchilla)"),
        ("effective_batch_size", rec["effective_batch_size"], rec["batch_basis"]),
        (
            "batch_size",
            rec["batch_size"],
            f"largest micro batch the memory model fits: {rec['predicted_memory_gb']:.2f} "
            f"of {rec['usable_memory_gb']:.2f} GiB usable; accumulation "
            f"{rec['accumulation']}",
        ),
        ("max_steps", rec["max_steps"], f"{rec['tokens']:,} tokens / (effective batch x block_size)"),
        ("warmup_steps", rec["warmup_steps"], "max(50, 0.03 x max_steps x batch / 32)"),
        ("clip", str(rec["clip"]), rec["clip_basis"]),
        ("label_smoothing", rec["label_smoothing"], rec["basis"]["label_smoothing"]),
        ("gradient_checkpointing", rec["gradient_checkpointing"], "as planned (--gradient_checkpointing)"),
    ]


def config_yaml(rec: dict, cfg: RecommendConfig, output: str = "RECOMMENDED.yaml") -> str:
    """The YAML train_pretrain.py --config reads; every value says where it came from."""
    lines = [f"# Recommended by `sweep.py recommend --from {cfg.from_dir} --memory-gb {cfg.memory_gb:g}`"]
    lines += [f"# note: {n}" for n in rec["notes"]]
    lines += [f"# {line}" for line in extrapolation_lines(rec)]
    lines += ["# confirm the lr first: three short runs at the target size, keep the lowest validation loss"]
    lines += [f"#   {c}" for c in confirmation_commands(rec, output)]
    lines += [
        f"{key}: {yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}  # {basis}"
        for key, value, basis in yaml_values(rec)
    ]
    return "\n".join(lines) + "\n"


def summary_table(rec: dict) -> str:
    rows = [(key, str(value), basis) for key, value, basis in yaml_values(rec)]
    width = max(len(r[0]) for r in rows)
    value_width = max(len(r[1]) for r in rows)
    lines = [f"{'option':<{width}}  {'value':<{value_width}}  basis", "-" * (width + value_width + 60)]
    lines += [f"{name:<{width}}  {value:<{value_width}}  {basis}" for name, value, basis in rows]
    lines += ["", *extrapolation_lines(rec), ""]
    lines += [f"note: {n}" for n in rec["notes"]]
    return "\n".join(lines)


def recommend_main(argv: list[str]) -> dict:
    parser = Parser(prog="sweep.py recommend", description=__doc__.split("\n")[0])
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
    print("before the long run, confirm the lr at the target size (keep the lowest validation loss):")
    print("\n".join(f"  {c}" for c in confirmation_commands(rec, str(output))))
    print(f"wrote {output}  (use: accelerate launch train_pretrain.py --config {output})")
    return rec
