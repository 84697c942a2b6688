"""Merge a LoRA adapter into its base (W' = W + (alpha/r)·B·A, via peft's merge_and_unload) and export a
standalone model.

The merge is checked, not trusted: logits of the merged fp32 model must match base+adapter (unmerged) on sample
inputs within a tolerance, the cast to the export dtype must stay finite and close, and the saved folder is reloaded
with plain transformers and must reproduce the cast model's logits. Only then is the folder published (temp
dir, rename).
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import psutil
import torch

from llmlab.core.device import resolve_device
from llmlab.core.errors import UserError
from llmlab.core.io import atomic_write_json, publish_dir
from llmlab.data.instruct import PROMPT_FILE
from llmlab.infer.config import CAST_REL_TOLERANCE, FP32_REL_TOLERANCE, MergeConfig
from llmlab.infer.loading import attach_adapter, from_pretrained_or_error, load_tokenizer_for, quiet_backend_logs
from llmlab.infer.quantize import FLOAT_DTYPES

SAMPLE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "In 1905 Albert Einstein published four papers that changed physics:",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Question: What is the capital of France?\nAnswer:",
)


def _sample_batch(tokenizer, max_positions: int):
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer(
        list(SAMPLE_TEXTS), return_tensors="pt", padding=True, truncation=True, max_length=min(64, max_positions)
    )


def _logits(model, batch):
    with torch.inference_mode():
        device = next(model.parameters()).device
        out = model(**{k: v.to(device) for k, v in batch.items()}).logits.float().cpu()
    return out[batch["attention_mask"].bool()]  # real tokens only: padded positions are meaningless


def _max_diff(a, b) -> float:
    return float((a - b).abs().max())


def merge_adapter(cfg: MergeConfig, log=print) -> dict:
    """Merge, verify, save; returns the report written to <out>/merge_report.json."""
    quiet_backend_logs()
    base, adapter, out = cfg.validate()
    device = resolve_device(cfg.device)
    log(f"loading {base} (fp32) + adapter {adapter}")
    model = from_pretrained_or_error(base, dtype=torch.float32).to(device).eval()
    if getattr(model, "is_quantized", False) or getattr(model.config, "quantization_config", None):
        raise UserError("the base model loaded quantized; merge into the full-precision base, then quantize")
    model = attach_adapter(model, adapter)
    tokenizer = load_tokenizer_for(adapter, base, name=cfg.tokenizer)
    batch = _sample_batch(tokenizer, model.config.max_position_embeddings)
    merged_model, checks = _merge_checked(model, batch, cfg, log)
    merged_model, cast, cast_checks = _cast_checked(merged_model, batch, checks["merged"], checks["scale"], cfg, log)
    report = {
        "base_model": cfg.base_model,
        "adapter": cfg.adapter,
        "dtype": cfg.dtype,
        "sample_tokens": checks["merged"].shape[0],
        **checks["report"],
        **cast_checks,
        "command": sys.argv,
    }
    reload_diff = _save_verified(merged_model, tokenizer, adapter, out, batch, cast, checks["scale"], cfg, report)
    log(
        f"saved standalone {cfg.dtype} model + tokenizer to {out} (loads with transformers alone; reload check "
        f"max diff {reload_diff:.1e})"
    )
    return report


def _merge_checked(model, batch, cfg: MergeConfig, log) -> tuple:
    """merge_and_unload, then the merged fp32 logits must equal base + adapter (unmerged) within the tolerance."""
    with model.disable_adapter():
        base_logits = _logits(model, batch)
    unmerged = _logits(model, batch)
    merged_model = model.merge_and_unload()
    merged = _logits(merged_model, batch)
    scale = float(unmerged.abs().max())
    tolerance = cfg.tolerance if cfg.tolerance is not None else FP32_REL_TOLERANCE * max(1.0, scale)
    adapter_effect, merge_diff = _max_diff(unmerged, base_logits), _max_diff(merged, unmerged)
    log(
        f"merge check (fp32, {merged.shape[0]} tokens): max |merged - base+adapter| = {merge_diff:.3e} "
        f"(tolerance {tolerance:.3e}); the adapter itself moves logits by up to {adapter_effect:.3e}"
    )
    if not merge_diff <= tolerance:
        raise UserError(
            f"merged logits differ from base+adapter by {merge_diff:.3e} > tolerance {tolerance:.3e}; "
            "the merge is wrong for this model (nothing was saved)"
        )
    if adapter_effect == 0.0:
        log("note: the adapter does not change the logits at all (lora_B still zero: an untrained adapter?)")
    report = {
        "max_abs_diff_merged_vs_unmerged_fp32": merge_diff,
        "tolerance_fp32": tolerance,
        "max_abs_adapter_effect": adapter_effect,
    }
    return merged_model, {"merged": merged, "scale": scale, "report": report}


def _cast_checked(merged_model, batch, merged, scale: float, cfg: MergeConfig, log) -> tuple:
    merged_model = merged_model.to(getattr(torch, FLOAT_DTYPES[cfg.dtype]))
    cast = _logits(merged_model, batch)
    cast_diff = _max_diff(cast, merged)
    cast_tolerance = CAST_REL_TOLERANCE[cfg.dtype] * max(1.0, scale)
    log(f"cast to {cfg.dtype}: max |{cfg.dtype} - fp32| = {cast_diff:.3e} (tolerance {cast_tolerance:.3e})")
    if not torch.isfinite(cast).all():
        raise UserError(f"{cfg.dtype} overflows for this model (non-finite logits); use --dtype bf16 or fp32")
    if cast_diff > cast_tolerance:
        raise UserError(
            f"{cfg.dtype} changes logits by {cast_diff:.3e} > {cast_tolerance:.3e}; use --dtype bf16 or fp32"
        )
    return merged_model, cast, {"max_abs_diff_cast_vs_fp32": cast_diff, "cast_tolerance": cast_tolerance}


# What a merge writes, for merges made before merge_report.json listed its files.
MERGE_OUTPUTS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",
    "merge_report.json",
    PROMPT_FILE,
)


def keep_user_files(out: Path, tmp: Path) -> None:
    """--overwrite replaces an earlier merge's files only: everything else in --out (the user's prompts, generate's
    outputs) moves into the new folder before it is published."""
    if not out.is_dir():
        return
    try:
        written = set(json.loads((out / "merge_report.json").read_text()).get("files") or [])
    except (OSError, ValueError, AttributeError):
        written = set()
    for entry in out.iterdir():
        ours = entry.name in written or (not written and any(fnmatch.fnmatch(entry.name, p) for p in MERGE_OUTPUTS))
        if not ours and not (tmp / entry.name).exists():
            os.replace(entry, tmp / entry.name)


def remove_abandoned_temps(out: Path) -> None:
    """Temp folders of merges into --out that were killed before publishing (their pid is gone): never reused."""
    for stale in out.parent.glob(f".{out.name}.tmp*-*"):
        pid = stale.name[len(f".{out.name}.tmp") :].split("-")[0]
        if stale.is_dir() and pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _save_verified(
    merged_model, tokenizer, adapter: str, out: Path, batch, cast, scale: float, cfg: MergeConfig, report: dict
) -> float:
    """Save into a temp folder, reload it with plain transformers, and publish only if it reproduces the logits."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_temps(out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp{os.getpid()}-"))
    try:
        merged_model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if (Path(adapter) / PROMPT_FILE).is_file():  # the prompt format the adapter was trained with
            shutil.copyfile(Path(adapter) / PROMPT_FILE, tmp / PROMPT_FILE)
        if not list(tmp.glob("*.safetensors")):
            raise RuntimeError(f"save_pretrained wrote no safetensors file into {tmp}")
        reloaded = from_pretrained_or_error(str(tmp), dtype=getattr(torch, FLOAT_DTYPES[cfg.dtype]))
        reload_diff = _max_diff(_logits(reloaded.to(next(merged_model.parameters()).device).eval(), batch), cast)
        if reload_diff > 1e-6 * max(1.0, scale):
            raise RuntimeError(f"the saved model does not reproduce the merged logits (max diff {reload_diff:.3e})")
        report["max_abs_diff_reloaded_vs_cast"] = reload_diff
        report["files"] = sorted(p.name for p in tmp.iterdir()) + ["merge_report.json"]
        atomic_write_json(tmp / "merge_report.json", report)
        keep_user_files(out, tmp)
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return reload_diff
