"""The causal-LM loss every trainer and trial computes, its perplexity, and the chunked head + loss.

The output layer and the cross-entropy as one chunked operation: the [tokens, vocab] logits never exist whole.

With GPT-2's 50,257-token vocabulary the logits dominate training memory: at batch 8 x 1024 tokens they are 1.6 GB
in fp32, and the usual path keeps them (and a float copy, and their gradient) alive until backward. Here each chunk
of tokens computes its logits, its loss and, while they are at hand, their gradients with respect to the hidden
states and the head weight; only those gradients are kept for backward. Same arithmetic as head + cross-entropy
(a test checks loss and gradients to 1e-5), no extra matmul, and peak memory is one chunk's logits. The idea is
liger-kernel's fused linear cross-entropy, whose Triton kernels need CUDA; this is the plain PyTorch version that
also runs on a CPU.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


def next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """The labels of causal LM training: each position's next token, -100 (ignored) after the last."""
    return F.pad(input_ids, (0, 1), value=-100)[..., 1:]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Next-token cross-entropy; labels are the inputs (shifted here), -100 positions are ignored.

    The labels are shifted (padded with -100 at the end), not the logits: slicing the logits would copy the
    whole batch x seq x vocab tensor, which on GPT-2's 50k vocabulary costs a third of the loss time.
    """
    shift_labels = next_token_labels(labels)
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        shift_labels.reshape(-1),
        ignore_index=-100,
        label_smoothing=label_smoothing,
    )


def perplexity(loss: Optional[float]) -> Optional[float]:
    """exp(loss), capped where exp would overflow a float (~709); None for a missing or non-finite loss."""
    if loss is None or not math.isfinite(loss):
        return None
    return math.exp(min(loss, 700.0))


DEFAULT_CHUNK_TOKENS = 1024  # one chunk's fp32 logits: 1024 x 50257 x 4 B = 206 MB


def _chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    smoothing: float,
    scale: torch.Tensor,
    want_grads: bool,
    logits: torch.Tensor,
):
    """Loss sum of one chunk; with `want_grads`, also d(loss * scale) / d(logits) for the chunk, written over
    `logits` (a reused buffer of the chunk's shape, float32 or wider). One exp per logit and no tensor of the
    logits' size allocated: on a CPU each pass over [chunk x 50257], and each fresh allocation of it (returned to
    the OS and page-faulted back in), is time next to the three matmuls (bench/head_passes.py: head forward and
    backward 1.20x the full-logits path, where the two-exp version with a new softmax per chunk ran 0.99x)."""
    if logits.dtype == weight.dtype:
        torch.mm(hidden, weight.t(), out=logits)
    else:  # bf16/fp16 matmul under autocast; softmax and loss in float32
        logits.copy_(hidden @ weight.t())
    valid = labels != -100
    safe = labels.clamp_min(0)
    rows = torch.arange(len(safe), device=logits.device)
    target = logits[rows, safe]
    mean = logits.mean(dim=-1) if smoothing else None
    peak = logits.amax(dim=-1, keepdim=True)
    probs = logits.sub_(peak).exp_()  # softmax numerators, in place of the logits
    total = probs.sum(dim=-1, keepdim=True)
    logsumexp = (peak + total.log()).squeeze(1)
    nll = logsumexp - target
    if smoothing:
        nll = (1 - smoothing) * nll + smoothing * (logsumexp - mean)
    loss_sum = (nll * valid).sum()
    if not want_grads:
        return loss_sum, None
    weights = valid * scale
    probs.mul_((weights / total.squeeze(1))[:, None])  # softmax x the token's weight in the mean
    if smoothing:
        probs.sub_((weights * smoothing / logits.size(-1))[:, None])
    probs[rows, safe] -= weights * (1 - smoothing)
    return loss_sum, probs


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, smoothing: float):
        scale = 1.0 / (labels != -100).sum().clamp_min(1).float()  # a tensor: reading the count would be a host sync
        want = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want else None
        total = hidden.new_zeros((), dtype=torch.float32)
        buffer = hidden.new_empty(
            (min(chunk, hidden.size(0)), weight.size(0)), dtype=torch.promote_types(weight.dtype, torch.float32)
        )
        for start in range(0, hidden.size(0), chunk):
            part = slice(start, start + chunk)
            rows = hidden[part].size(0)
            loss_sum, grad = _chunk(hidden[part], weight, labels[part], smoothing, scale, want, buffer[:rows])
            total += loss_sum
            if want:  # the two backward matmuls of the head, in the matmul dtype (bf16 under autocast)
                grad = grad.to(weight.dtype)
                torch.mm(grad, weight, out=grad_hidden[part])
                if grad.dtype == grad_weight.dtype:
                    grad_weight.addmm_(grad.t(), hidden[part])
                else:  # bf16 products, accumulated in float32
                    grad_weight += grad.t() @ hidden[part]
        if want:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return total * scale

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_output, grad_weight * grad_output, None, None, None


def chunked_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    label_smoothing: float = 0.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """Next-token cross-entropy of `hidden` [batch, seq, width] through the head `weight` [vocab, width], with the
    inputs as labels (shifted here, -100 ignored): the same value as causal_lm_loss(F.linear(hidden, weight), ...)."""
    labels = next_token_labels(input_ids).reshape(-1)
    flat = hidden.reshape(-1, hidden.size(-1))
    device = flat.device.type
    # Under autocast the head's matmuls run in its dtype (as F.linear would); softmax and the loss stay fp32.
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else flat.dtype
    with torch.autocast(device, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(flat.to(dtype), weight.to(dtype), labels, chunk_tokens, label_smoothing)


class CausalLMWithLoss(nn.Module):
    """Wraps a Hugging Face causal LM so that forward(input_ids) returns its next-token loss: through the chunked
    head (`chunk_tokens` > 0) or the model's own full logits (0). Prepared by accelerate like the model itself, so
    DDP and DeepSpeed see every forward; `.model` is the Hugging Face model to save."""

    def __init__(self, model: nn.Module, label_smoothing: float = 0.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
        super().__init__()
        self.model, self.label_smoothing, self.chunk_tokens = model, label_smoothing, chunk_tokens

    def forward(self, input_ids: torch.Tensor, label_smoothing: float | None = None) -> torch.Tensor:
        smoothing = self.label_smoothing if label_smoothing is None else label_smoothing
        if not self.chunk_tokens:
            return causal_lm_loss(self.model(input_ids=input_ids).logits, input_ids, smoothing)
        hidden = self.model.base_model(input_ids=input_ids).last_hidden_state
        head = self.model.get_output_embeddings().weight
        return chunked_lm_loss(hidden, head, input_ids, smoothing, self.chunk_tokens)
