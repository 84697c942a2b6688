"""Precisions and quantization: which precision runs where, CPU dynamic INT8, and bitsandbytes configs.

On CUDA the low-bit paths are bitsandbytes (LLM.int8 and 4-bit NF4). On CPU, INT8 is PyTorch dynamic quantization
(int8 weights, activations quantized per batch): `quantize_dynamic` only replaces `nn.Linear`, and GPT-2 keeps its
projections in transformers' `Conv1D` (the transposed layout), so those are converted to `nn.Linear` first --
otherwise only lm_head would be quantized and the model would silently stay float. Every quantized load is checked
to have really replaced the layers it claims to.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantLinear
from torch.ao.quantization import quantize_dynamic
from transformers import BitsAndBytesConfig
from transformers.pytorch_utils import Conv1D

from llmlab.core.errors import UserError
from llmlab.infer.config import PRECISIONS

FLOAT_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def unavailable_reason(precision: str, device: str) -> str | None:
    """None if `precision` runs on `device`; otherwise a sentence naming what would run it."""
    if precision == "fp32":
        return None
    if device == "cuda":
        if precision == "bf16" and not torch.cuda.is_bf16_supported():
            return "this GPU has no bf16 support; use --precision fp16 (or int8/int4)"
        if precision in ("int8", "int4") and not _bitsandbytes_ok():
            return f"{precision} on CUDA needs bitsandbytes (pip install bitsandbytes)"
        return None
    if precision == "fp16":
        return (
            "fp16 inference needs a CUDA GPU (PyTorch's CPU fp16 matmuls are slow and overflow-prone); "
            "on CPU use --precision bf16 or fp32"
        )
    if precision == "int4" and not _bitsandbytes_ok():
        return (
            "4-bit NF4 needs bitsandbytes (pip install bitsandbytes; its CPU backend runs it here) "
            "or a CUDA GPU; on CPU use --precision int8"
        )
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


def conv1d_to_linear(model) -> int:
    """Replace every transformers Conv1D (y = x W + b, W: in x out) by an equal nn.Linear (W^T). Returns the count."""
    converted = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                in_features, out_features = child.weight.shape
                linear = torch.nn.Linear(
                    in_features,
                    out_features,
                    bias=child.bias is not None,
                    dtype=child.weight.dtype,
                    device=child.weight.device,
                )
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    if child.bias is not None:
                        linear.bias.copy_(child.bias)
                setattr(parent, name, linear)
                converted += 1
    return converted


class SharedEmbedding(torch.nn.Module):
    """The token embedding stored in a low precision (bf16), handing fp32 vectors to the (quantized) layers."""

    def __init__(self, weight: torch.nn.Parameter, padding_idx=None):
        super().__init__()
        self.weight, self.padding_idx = weight, padding_idx

    def forward(self, input_ids):
        return F.embedding(input_ids, self.weight, self.padding_idx).float()


class SharedHead(torch.nn.Module):
    """The output layer on the same low-precision matrix as the embedding: fp32 in, fp32 logits out."""

    def __init__(self, weight: torch.nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, hidden):
        return F.linear(hidden.to(self.weight.dtype), self.weight).float()


def keep_tie_in_bf16(model) -> bool:
    """A tied embedding/head (GPT-2) as one bf16 matrix for both uses, never quantized twice.

    Dynamic INT8 and bitsandbytes quantize the head as a Linear of its own, which means a second copy of the
    largest matrix next to the float embedding: the INT8 gpt2-tiny was bigger than fp32 (64.7 vs 61.4 MB). Kept as
    one bf16 matrix the tie holds and every low-bit variant is smaller than bf16. Returns False (nothing changed)
    for a model whose head is not tied."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None or head.weight.data_ptr() != embedding.weight.data_ptr():
        return False
    weight = torch.nn.Parameter(embedding.weight.detach().to(torch.bfloat16), requires_grad=False)
    model.set_input_embeddings(SharedEmbedding(weight, embedding.padding_idx))
    model.set_output_embeddings(SharedHead(weight))
    return True


def quantize_int8_dynamic(model) -> dict[str, Any]:
    """Dynamic INT8 on CPU (modifies `model`); returns the quantized model and layer counts. Verifies it took.
    A tied embedding/head stays one bf16 matrix (keep_tie_in_bf16); every other Linear becomes INT8."""
    model = model.float().eval()
    tied = keep_tie_in_bf16(model)
    converted = conv1d_to_linear(model)
    float_linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    quantized = quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    n_quant = sum(isinstance(m, DynamicQuantLinear) for m in quantized.modules())
    left = sum(type(m) is torch.nn.Linear for m in quantized.modules())
    if n_quant == 0 or n_quant != float_linears or left:
        raise RuntimeError(
            f"INT8 dynamic quantization did not take: {n_quant} of {float_linears} Linear layers "
            f"quantized, {left} still float"
        )
    return {"model": quantized, "conv1d_converted": converted, "int8_layers": n_quant, "tied_head_bf16": tied}


def count_quantized_layers(model) -> int:
    """Layers whose weights are really stored in low precision (torch dynamic INT8 or bitsandbytes)."""
    kinds: tuple = (DynamicQuantLinear,)
    try:
        import bitsandbytes as bnb

        kinds += (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)
    except Exception:
        pass
    return sum(isinstance(m, kinds) for m in model.modules())


def bnb_config(precision: str, device: str):
    if precision == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = torch.bfloat16 if device == "cuda" and torch.cuda.is_bf16_supported() else torch.float16
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute if device == "cuda" else torch.float32,
    )
