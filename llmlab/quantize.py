"""Loading a causal LM at a chosen precision: fp32/fp16/bf16, INT8, 4-bit NF4 -- or a clear error saying what would run it.

On CUDA the low-bit paths are bitsandbytes (LLM.int8 and 4-bit NF4). On CPU, INT8 is PyTorch dynamic quantization
(int8 weights, activations quantized per batch): `quantize_dynamic` only replaces `nn.Linear`, and GPT-2 keeps its
projections in transformers' `Conv1D` (the transposed layout), so those are converted to `nn.Linear` first --
otherwise only lm_head would be quantized and the model would silently stay float. Every quantized load is checked
to have really replaced the layers it claims to.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmlab.errors import UserError
from llmlab.runinfo import resolve_device

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int4")
FLOAT_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def quiet_backend_logs() -> None:
    """Silence import-time chatter (missing optional kernels, deprecations, progress bars) that buries results."""
    import warnings

    for name in ("torchao", "bitsandbytes", "torch.utils._pytree", "DeepSpeed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch

    if not torch.cuda.is_available():  # else DeepSpeed (imported by transformers' integrations) warns it chose CPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")  # torch.ao INT8 path
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    warnings.filterwarnings("ignore", category=UserWarning, module="peft")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def unavailable_reason(precision: str, device: str) -> str | None:
    """None if `precision` runs on `device`; otherwise a sentence naming what would run it."""
    import torch

    if precision == "fp32":
        return None
    if device == "cuda":
        if precision == "bf16" and not torch.cuda.is_bf16_supported():
            return "this GPU has no bf16 support; use --precision fp16 (or int8/int4)"
        if precision in ("int8", "int4") and not _bitsandbytes_ok():
            return f"{precision} on CUDA needs bitsandbytes (pip install bitsandbytes)"
        return None
    if precision == "fp16":
        return ("fp16 inference needs a CUDA GPU (PyTorch's CPU fp16 matmuls are slow and overflow-prone); "
                "on CPU use --precision bf16 or fp32")
    if precision == "int4" and not _bitsandbytes_ok():
        return ("4-bit NF4 needs bitsandbytes (pip install bitsandbytes; its CPU backend runs it here) "
                "or a CUDA GPU; on CPU use --precision int8")
    return None  # fp32, bf16, int8 (PyTorch dynamic) and int4 (bitsandbytes CPU backend) run on CPU


def available_precisions(device: str) -> list[str]:
    return [p for p in PRECISIONS if unavailable_reason(p, device) is None]


def default_precision(device: str) -> str:
    return "fp16" if device == "cuda" else "fp32"


def check_precision(precision: str, device: str) -> str:
    if precision == "auto":
        return default_precision(device)
    reason = unavailable_reason(precision, device)
    if reason:
        raise UserError(f"--precision {precision} is not available on {device}: {reason}")
    return precision


def _bitsandbytes_ok() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except Exception:
        return False
    return True


def _offline() -> bool:
    return any(os.environ.get(v, "0").lower() not in ("0", "", "false", "no")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def check_model_source(name: str, what: str = "--model",
                       hint: str = "pass a folder written by save_pretrained, e.g. the --out of `merge_and_infer.py merge`",
                       marker: str = "config.json") -> str:
    """A local folder must exist and hold `marker`; anything else is tried as a hub name unless offline."""
    path = Path(name).expanduser()
    if path.exists():
        if marker == "config.json" and (path / "adapter_config.json").is_file():
            raise UserError(f"{what} {name} is a LoRA adapter folder; pass it as --adapter with --base_model BASE")
        if not path.is_dir() or not (path / marker).is_file():
            raise UserError(f"{what} {name}: not {'an adapter' if 'adapter' in marker else 'a model'} folder "
                            f"(no {marker}); {hint}")
        return str(path)
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1
    if _offline() or looks_local:
        extra = "" if looks_local else " (or unset HF_HUB_OFFLINE to download a hub name)"
        raise UserError(f"{what} {name}: folder not found; {hint}{extra}")
    return name


def check_adapter_source(name: str) -> str:
    return check_model_source(name, "--adapter", "pass the folder train_lora.py saved the adapter to "
                              "(adapter_config.json + adapter_model.safetensors)", marker="adapter_config.json")


def quantization_config_of(model_dir: str) -> dict | None:
    """The quantization_config recorded in a local model folder's config.json (None if full precision)."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    return json.loads(config_file.read_text()).get("quantization_config")


# ---- CPU INT8 ---------------------------------------------------------------------------------------------------

def conv1d_to_linear(model) -> int:
    """Replace every transformers Conv1D (y = x W + b, W: in x out) by an equal nn.Linear (W^T). Returns the count."""
    import torch
    from transformers.pytorch_utils import Conv1D

    converted = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                in_features, out_features = child.weight.shape
                linear = torch.nn.Linear(in_features, out_features, bias=child.bias is not None,
                                         dtype=child.weight.dtype, device=child.weight.device)
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    if child.bias is not None:
                        linear.bias.copy_(child.bias)
                setattr(parent, name, linear)
                converted += 1
    return converted


def quantize_int8_dynamic(model) -> dict[str, Any]:
    """Dynamic INT8 on CPU (modifies `model`); returns the quantized model and layer counts. Verifies it took."""
    import torch
    from torch.ao.quantization import quantize_dynamic
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantLinear

    model = model.float().eval()
    converted = conv1d_to_linear(model)
    float_linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    quantized = quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    n_quant = sum(isinstance(m, DynamicQuantLinear) for m in quantized.modules())
    left = sum(type(m) is torch.nn.Linear for m in quantized.modules())
    if n_quant == 0 or n_quant != float_linears or left:
        raise RuntimeError(f"INT8 dynamic quantization did not take: {n_quant} of {float_linears} Linear layers "
                           f"quantized, {left} still float")
    return {"model": quantized, "conv1d_converted": converted, "int8_layers": n_quant}


def count_quantized_layers(model) -> int:
    """Layers whose weights are really stored in low precision (torch dynamic INT8 or bitsandbytes)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantLinear

    kinds: tuple = (DynamicQuantLinear,)
    try:
        import bitsandbytes as bnb

        kinds += (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)
    except Exception:
        pass
    return sum(isinstance(m, kinds) for m in model.modules())


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
    from llmlab.tokenizer import load_tokenizer

    if name:
        return load_tokenizer(name)
    from transformers import AutoTokenizer

    for source in sources:
        if source and Path(source).is_dir() and any(
                (Path(source) / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer_config.json")):
            return AutoTokenizer.from_pretrained(source)
    return load_tokenizer()


def from_pretrained_or_error(name: str, **kwargs):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load model {name!r}: {str(err).splitlines()[0][:200]}") from None


def _bnb_config(precision: str, device: str):
    import torch
    from transformers import BitsAndBytesConfig

    if precision == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = torch.bfloat16 if device == "cuda" and torch.cuda.is_bf16_supported() else torch.float16
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute if device == "cuda" else torch.float32)


def load_base(name: str, precision: str, device: str):
    """The model at `precision` on `device` (no adapter). Returns (model, quantized_layer_count)."""
    import torch

    if precision in FLOAT_DTYPES:
        model = from_pretrained_or_error(name, dtype=getattr(torch, FLOAT_DTYPES[precision]))
        return model.to(device).eval(), 0
    if precision == "int8" and device == "cpu":
        report = quantize_int8_dynamic(from_pretrained_or_error(name, dtype=torch.float32))
        return report["model"], report["int8_layers"]
    # bitsandbytes: CUDA kernels, or its CPU backend for int4 (measured faster than fp32 on CPU, slower than
    # PyTorch's dynamic INT8, so int8 on CPU uses the latter)
    config = _bnb_config(precision, device)
    # the layers bitsandbytes leaves alone (embeddings, norms, lm_head) stay in the compute dtype, not fp16
    keep = config.bnb_4bit_compute_dtype if precision == "int4" else (
        torch.float32 if device == "cpu" else torch.float16)  # LLM.int8 kernels take fp16 activations
    model = from_pretrained_or_error(name, quantization_config=config, dtype=keep,
                                     device_map={"": 0} if device == "cuda" else "cpu")
    n = count_quantized_layers(model)
    if n == 0:
        raise RuntimeError(f"bitsandbytes {precision} load left every layer in full precision")
    return model.eval(), n


def attach_adapter(model, adapter: str):
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(model, adapter).eval()
    except (RuntimeError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()
        detail = next((line.strip() for line in first if "size mismatch" in line), first[0] if first else "")
        trained_on = ""
        try:
            trained_on = json.loads((Path(adapter) / "adapter_config.json").read_text()).get(
                "base_model_name_or_path") or ""
        except (OSError, ValueError):
            pass
        raise UserError(f"--adapter {adapter} does not fit this base model ({detail[:160]}); it was trained on "
                        f"{trained_on or 'another base'}: pass that as --base_model") from None


def load_for_inference(*, model: str | None = None, base_model: str | None = None, adapter: str | None = None,
                       precision: str = "auto", device: str = "auto", tokenizer: str | None = None,
                       merge_adapter: bool = False) -> LoadedModel:
    """A merged model folder, or a base + LoRA adapter kept unmerged (merged in memory where a backend needs it)."""
    quiet_backend_logs()
    device = resolve_device(device)
    precision = check_precision(precision, device)
    source = model or base_model
    assert source, "model or base_model is required"
    notes: list[str] = []
    if adapter is None:
        net, n_quant = load_base(source, precision, device)
        return LoadedModel(net, load_tokenizer_for(source, name=tokenizer), precision, device, notes, n_quant)
    if precision == "int8" and device == "cpu":
        notes.append("int8 on CPU: the adapter is merged into the fp32 base in memory, then quantized "
                     "(PyTorch's dynamic INT8 layers cannot host a LoRA adapter)")
        net, _ = load_base(source, "fp32", device)
        net = attach_adapter(net, adapter).merge_and_unload()
        report = quantize_int8_dynamic(net)
        net, n_quant = report["model"], report["int8_layers"]
    else:
        net, n_quant = load_base(source, precision, device)
        net = attach_adapter(net, adapter)
        if merge_adapter:
            if n_quant:
                raise UserError("cannot merge an adapter into a quantized base; merge in full precision first")
            net = net.merge_and_unload()
    return LoadedModel(net, load_tokenizer_for(adapter, source, name=tokenizer), precision, device, notes, n_quant)
