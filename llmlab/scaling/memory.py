"""Training memory on one GPU from arithmetic, calibrated by measured GPU peaks when the scan has them.

Model states, bytes per parameter (mixed precision keeps fp32 master weights; Rajbhandari et al. 2020, ZeRO):
  plain (accelerate, autocast)        weights 4 + gradients 4 + optimizer states
  DeepSpeed ZeRO-2 on one GPU          16-bit weights 2 + 16-bit gradients 2 + fp32 master 4 + optimizer states
  ZeRO-2 with CPU optimizer offload    16-bit weights 2 + 16-bit gradients 2 on the GPU (master and states on the CPU)
Optimizer states: AdamW 8 (two fp32 moments), Lion 4 (one), Adafactor ~0 (factored second moments, no momentum).
Activations per token and layer: 34 d bytes at 16 bits (Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", with memory-efficient attention so no s^2 term; 68 d at fp32); with gradient
checkpointing each layer keeps only its 16-bit input (2 d) and one layer is recomputed at a time. The chunked loss
keeps one chunk of logits (chunk x vocab x fp32 x 2) whatever the batch. A fixed 1 GiB covers the CUDA context and
the allocator's cache, which torch.cuda.max_memory_allocated leaves out.

CPU RSS of tiny probes is never extrapolated: it is mostly torch itself. Only trials that measured
`torch.cuda.max_memory_allocated` calibrate the model (median measured / predicted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from llmlab.core.errors import UserError
from llmlab.train.components import OPTIMIZERS

GIB = 2**30
CONTEXT_BYTES = 1 * GIB
VOCAB = 50257


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    vocab_size: int = VOCAB
    seq_len: int = 1024

    @property
    def non_embedding(self) -> int:
        return 12 * self.n_layer * self.n_embd**2

    @property
    def total(self) -> int:  # tied input/output embedding + learned positions
        return self.non_embedding + (self.vocab_size + self.seq_len) * self.n_embd


def shape_for(params: float, seq_len: int, n_layer: Optional[int] = None, n_embd: Optional[int] = None) -> Shape:
    """A GPT-2-family shape with N = 12 L d^2 non-embedding parameters: the given layers/width, or GPT-2 small's
    aspect ratio d = 64 L (768 / 12) with d a multiple of 64."""
    if n_layer and n_embd:
        return Shape(n_layer, n_embd, seq_len=seq_len)
    if n_embd:
        return Shape(max(1, round(params / (12 * n_embd**2))), n_embd, seq_len=seq_len)
    if n_layer:
        return Shape(n_layer, max(64, 64 * round(math.sqrt(params / (12 * n_layer)) / 64)), seq_len=seq_len)
    layers = max(1, round((params / (12 * 64**2)) ** (1 / 3)))
    return Shape(layers, max(64, 64 * round(math.sqrt(params / (12 * layers)) / 64)), seq_len=seq_len)


def state_bytes_per_param(optimizer: str, zero_stage: int, offload: bool, precision: str) -> float:
    states = OPTIMIZERS[optimizer].state_bytes
    if zero_stage == 0:
        return 4.0 + 4.0 + states
    if precision == "no":
        raise UserError(
            "a ZeRO-2 memory plan needs mixed precision (bf16 or fp16): fp32 DeepSpeed keeps no 16-bit "
            "copy; pass --precision bf16"
        )
    return 2.0 + 2.0 + (0.0 if offload else 4.0 + states)


def activation_bytes_per_token(shape: Shape, precision: str, gradient_checkpointing: bool) -> float:
    scale = 2.0 if precision == "no" else 1.0  # fp32 activations are twice the 16-bit ones
    per_layer = 34.0 * shape.n_embd * scale
    if gradient_checkpointing:
        return shape.n_layer * 2.0 * shape.n_embd * scale + per_layer
    return shape.n_layer * per_layer + 4.0 * shape.n_embd * scale  # + embeddings and the final LayerNorm


def predicted_bytes(
    shape: Shape,
    micro_batch: int,
    optimizer: str = "adamw",
    precision: str = "bf16",
    zero_stage: int = 0,
    offload: bool = False,
    gradient_checkpointing: bool = False,
    loss_chunk_tokens: int = 1024,
    calibration: float = 1.0,
) -> dict:
    """Peak GPU bytes of one training step, by part."""
    states = shape.total * state_bytes_per_param(optimizer, zero_stage, offload, precision)
    tokens = micro_batch * shape.seq_len
    activations = tokens * activation_bytes_per_token(shape, precision, gradient_checkpointing)
    logits = min(tokens, loss_chunk_tokens or tokens) * shape.vocab_size * 4 * 2
    measured_parts = (states + activations + logits) * calibration
    return {
        "states": states,
        "activations": activations,
        "logits": logits,
        "calibration": calibration,
        "context": CONTEXT_BYTES,
        "total": measured_parts + CONTEXT_BYTES,
    }


def calibrate(trials: list[dict]) -> tuple[float, str]:
    """Median of measured / predicted over the trials that measured a GPU peak (memory_source cuda), else 1."""
    ratios = []
    for trial in trials:
        if trial.get("memory_source") != "cuda" or not trial.get("peak_memory_mb") or not trial.get("model_width"):
            continue
        shape = Shape(int(trial["model_depth"]), int(trial["model_width"]), seq_len=int(trial.get("seq_len") or 128))
        micro = int(trial.get("micro_batch_size") or trial["batch_size"])
        parts = predicted_bytes(
            shape, micro, str(trial.get("optimizer", "adamw")), "no" if trial.get("precision") == "fp32" else "bf16"
        )
        ratios.append(float(trial["peak_memory_mb"]) * 2**20 / (parts["total"] - CONTEXT_BYTES))
    if not ratios:
        return 1.0, "uncalibrated: the scan measured no GPU peaks (CPU trials record RSS, which is not used)"
    ratios.sort()
    factor = ratios[len(ratios) // 2]
    return factor, f"calibrated by {len(ratios)} GPU trial(s): measured / predicted = {factor:.2f} (median)"
