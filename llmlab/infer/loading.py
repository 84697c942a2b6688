"""Loading a causal LM for inference: a merged folder, or a base model + LoRA adapter kept unmerged, at a chosen
precision (precisions and quantization live in quantize.py); every path problem is a one-line error."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from llmlab.core.device import resolve_device
from llmlab.core.errors import UserError
from llmlab.core.notices import quiet_known_notices
from llmlab.data.tokenizer import load_tokenizer
from llmlab.infer.config import check_adapter_source, check_model_source, quantization_config_of  # noqa: F401 (re-exported)
from llmlab.infer.quantize import (
    FLOAT_DTYPES,
    bnb_config,
    check_precision,
    count_quantized_layers,
    keep_tie_in_bf16,
    quantize_int8_dynamic,
)


def quiet_backend_logs() -> None:
    """Silence import-time chatter (missing optional kernels, deprecations, progress bars) that buries results."""
    quiet_known_notices()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if not torch.cuda.is_available():  # else DeepSpeed (imported by transformers' integrations) warns it chose CPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")  # torch.ao INT8 path
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    warnings.filterwarnings("ignore", category=UserWarning, module="peft")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# ---- loading ----------------------------------------------------------------------------------------------------


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    precision: str
    device: str
    notes: list[str] = field(default_factory=list)
    quantized_layers: int = 0


def load_tokenizer_for(*sources: str | None, name: str | None = None):
    """The tokenizer saved with the model (or adapter); --tokenizer overrides; the offline GPT-2 BPE last."""
    if name:
        return load_tokenizer(name)
    for source in sources:
        if (
            source
            and Path(source).is_dir()
            and any((Path(source) / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer_config.json"))
        ):
            return AutoTokenizer.from_pretrained(source)
    return load_tokenizer()


def from_pretrained_or_error(name: str, **kwargs):
    try:
        return AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load model {name!r}: {str(err).splitlines()[0][:200]}") from None


def load_at_precision(name: str, precision: str, device: str):
    """The model at `precision` on `device` (no adapter). Returns (model, quantized_layer_count)."""
    if precision in FLOAT_DTYPES:
        model = from_pretrained_or_error(name, dtype=getattr(torch, FLOAT_DTYPES[precision]))
        return model.to(device).eval(), 0
    if precision == "int8" and device == "cpu":
        report = quantize_int8_dynamic(from_pretrained_or_error(name, dtype=torch.float32))
        return report["model"], report["int8_layers"]
    # bitsandbytes: CUDA kernels, or its CPU backend for int4 (measured faster than fp32 on CPU, slower than
    # PyTorch's dynamic INT8, so int8 on CPU uses the latter)
    config = bnb_config(precision, device)
    # the layers bitsandbytes leaves alone (embeddings, norms, lm_head) stay in the compute dtype, not fp16
    keep = (
        config.bnb_4bit_compute_dtype if precision == "int4" else (torch.float32 if device == "cpu" else torch.float16)
    )  # LLM.int8 kernels take fp16 activations
    model = from_pretrained_or_error(
        name, quantization_config=config, dtype=keep, device_map={"": 0} if device == "cuda" else "cpu"
    )
    n = count_quantized_layers(model)
    if n == 0:
        raise RuntimeError(f"bitsandbytes {precision} load left every layer in full precision")
    if device == "cpu":  # bitsandbytes keeps the tied embedding/head in fp32 on CPU: one bf16 matrix instead
        keep_tie_in_bf16(model)
    return model.eval(), n


def attach_adapter(model, adapter: str):
    try:
        return PeftModel.from_pretrained(model, adapter).eval()
    except (RuntimeError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()
        detail = next((line.strip() for line in first if "size mismatch" in line), first[0] if first else "")
        trained_on = ""
        try:
            trained_on = (
                json.loads((Path(adapter) / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
            )
        except (OSError, ValueError):
            pass
        raise UserError(
            f"--adapter {adapter} does not fit this base model ({detail[:160]}); it was trained on "
            f"{trained_on or 'another base'}: pass that as --base_model"
        ) from None


def load_for_inference(
    *,
    model: str | None = None,
    base_model: str | None = None,
    adapter: str | None = None,
    precision: str = "auto",
    device: str = "auto",
    tokenizer: str | None = None,
    merge_adapter: bool = False,
) -> LoadedModel:
    """A merged model folder, or a base + LoRA adapter kept unmerged (merged in memory where a backend needs it)."""
    quiet_backend_logs()
    device = resolve_device(device)
    precision = check_precision(precision, device)
    source = model or base_model
    assert source, "model or base_model is required"
    notes: list[str] = []
    if adapter is None:
        net, n_quant = load_at_precision(source, precision, device)
        return LoadedModel(net, load_tokenizer_for(source, name=tokenizer), precision, device, notes, n_quant)
    if precision == "int8" and device == "cpu":
        notes.append(
            "int8 on CPU: the adapter is merged into the fp32 base in memory, then quantized "
            "(PyTorch's dynamic INT8 layers cannot host a LoRA adapter)"
        )
        net, _ = load_at_precision(source, "fp32", device)
        net = attach_adapter(net, adapter).merge_and_unload()
        report = quantize_int8_dynamic(net)
        net, n_quant = report["model"], report["int8_layers"]
    else:
        net, n_quant = load_at_precision(source, precision, device)
        net = attach_adapter(net, adapter)
        if merge_adapter:
            if n_quant:
                raise UserError("cannot merge an adapter into a quantized base; merge in full precision first")
            net = net.merge_and_unload()
    return LoadedModel(net, load_tokenizer_for(adapter, source, name=tokenizer), precision, device, notes, n_quant)


def load_from_config(cfg, log=print) -> LoadedModel:
    """What --model / --base_model + --adapter, --precision, --device, --tokenizer and --threads of a command ask
    for (generate, eval), its notes said once."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    loaded = load_for_inference(
        model=cfg.model,
        base_model=cfg.base_model,
        adapter=cfg.adapter,
        precision=cfg.precision,
        device=cfg.device,
        tokenizer=cfg.tokenizer,
    )
    for note in loaded.notes:
        log(f"note: {note}")
    return loaded
