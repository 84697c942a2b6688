"""muP for Hugging Face GPT-2 (Yang et al. 2022, "Tensor Programs V"): the same rules as the lab's minimal Transformer
(llmlab/models/minimal.py), on the model the trainers train, with m = n_embd / base_width.

- Hidden matrices (c_attn, c_fc) are drawn with std 0.02 / sqrt(m), the residual projections (both c_proj) with
  GPT-2's extra 1 / sqrt(2 n_layer); embeddings, biases and LayerNorms keep GPT-2's init. Nothing is redrawn at m = 1,
  so muP at its base width is the standard model, bit for bit, from the same seed.
- Adam lr x 1 / m on the hidden matrices (`lr_multipliers`, which the optimizer factory applies).
- The tied readout divided by m: ln_f becomes `MupReadoutNorm`, whose output only the head reads. Saving folds the
  multiplier into ln_f's weight and bias (`fold_readout`), so a saved model is a plain GPT-2 with the same logits.
- Attention keeps GPT-2's 1 / sqrt(d_head). The lab's GPT-2 family has heads of 64 at every width, so d_head does not
  change with width and muP's 1 / d_head would only scale every width's scores by the same 1/8; keeping GPT-2's
  scale keeps the saved model a plain GPT-2.

The `mup` package does this by wrapping modules (MuReadout, set_base_shapes); it needs torchvision, which this project
does not install, and its readout would not save as a plain GPT-2.
"""

from __future__ import annotations

import math

import torch.nn as nn

# The hidden matrices of a GPT-2 block (HF Conv1D, stored [in, out]): the weights muP scales with width.
HIDDEN_MATRICES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class MupReadoutNorm(nn.LayerNorm):
    """GPT-2's final LayerNorm times muP's readout multiplier 1 / m. Only the tied head reads ln_f's output, so this is
    logits / m (muP's MuSharedReadout) without touching the embedding the head shares; the state-dict keys are ln_f's
    own, so checkpoints and resume see an ordinary GPT-2."""

    readout_multiplier: float = 1.0

    @classmethod
    def replacing(cls, norm: nn.LayerNorm, multiplier: float) -> "MupReadoutNorm":
        new = cls(norm.normalized_shape, eps=norm.eps, device=norm.weight.device, dtype=norm.weight.dtype)
        new.load_state_dict(norm.state_dict())
        new.readout_multiplier = multiplier
        return new

    def forward(self, x):
        out = super().forward(x)
        return out if self.readout_multiplier == 1.0 else out * self.readout_multiplier

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, readout_multiplier={self.readout_multiplier:.6g}"


def apply_mup(model, base_width: int) -> None:
    """muP's init and readout on a fresh GPT2LMHeadModel (see the module's docstring)."""
    mult = model.config.n_embd / base_width
    if mult != 1.0:
        std = model.config.initializer_range / math.sqrt(mult)
        residual = std / math.sqrt(2 * model.config.n_layer)
        for block in model.transformer.h:
            for layer, layer_std in (
                (block.attn.c_attn, std),
                (block.mlp.c_fc, std),
                (block.attn.c_proj, residual),
                (block.mlp.c_proj, residual),
            ):
                nn.init.normal_(layer.weight, std=layer_std)
    model.transformer.ln_f = MupReadoutNorm.replacing(model.transformer.ln_f, 1.0 / mult)


def width_mult(model) -> float:
    """muP's m of a GPT-2 built by apply_mup; 1.0 for a standard one."""
    norm = getattr(getattr(model, "transformer", None), "ln_f", None)
    return 1.0 / norm.readout_multiplier if isinstance(norm, MupReadoutNorm) else 1.0


def lr_multipliers(model) -> dict[str, float]:
    """Per-parameter Adam lr multipliers by name: 1 / m on a muP GPT-2's hidden matrices, 1 everywhere else (the
    minimal Transformer has its own)."""
    if hasattr(model, "lr_multipliers"):
        return model.lr_multipliers()
    mult = width_mult(model)
    return {name: (1 / mult if name.endswith(HIDDEN_MATRICES) else 1.0) for name, _ in model.named_parameters()}


def hidden_matrices(model) -> dict[str, tuple[int, int]]:
    """name -> (axis, matrices it holds along that axis) of the model's hidden matrices (what Muon steps apart): GPT-2's
    c_attn ([n_embd, 3 n_embd], Conv1D's [in, out]) holds Q, K and V side by side; the minimal Transformer names its
    own."""
    if hasattr(model, "hidden_matrices"):
        return model.hidden_matrices()
    return {
        name: ((1, 3) if name.endswith("attn.c_attn.weight") else (0, 1))
        for name, _ in model.named_parameters()
        if name.endswith(HIDDEN_MATRICES)
    }


def fold_readout(model, state_dict: dict) -> dict:
    """The state dict of a plain GPT-2 with the same logits: the readout multiplier folded into ln_f's weight and
    bias (the head reads W_e (g * x_hat + b) / m = W_e ((g / m) * x_hat + b / m)). A standard model's is unchanged."""
    mult = width_mult(model)
    if mult == 1.0:
        return state_dict
    folded = dict(state_dict)
    for key in ("transformer.ln_f.weight", "transformer.ln_f.bias"):
        folded[key] = state_dict[key] / mult
    return folded
