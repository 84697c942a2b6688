"""Muon for the hidden matrices and AdamW for the rest, stepped as one optimizer (nanochat's and modded-nanogpt's
split), on torch 2.13's own Muon arithmetic.

- The hidden matrices (each block's attention and MLP weights) take Muon's step: Nesterov momentum 0.95, the update
  orthogonalised by 5 Newton-Schulz iterations, its lr adjusted with torch's `match_rms_adamw` (0.2 x sqrt(max
  dim)), so Muon's updates have AdamW's RMS and take the run's --learning_rate and --weight_decay unchanged.
- A fused projection is orthogonalised as the matrices it holds: GPT-2's c_attn ([n_embd, 3 n_embd], HF Conv1D's
  [in, out]) and the minimal Transformer's qkv ([3 width, width]) as their Q, K and V blocks, each with its own
  lr adjustment, as modded-nanogpt does. Orthogonalising the fused matrix would couple three maps that attention
  uses apart, and give each the shape factor of a matrix 3x wider.
- Everything else (embeddings, the tied head, LayerNorms, biases) takes AdamW, whose groups and state this optimizer
  holds too: one state_dict, one set of param_groups for the schedule, one step for the engine.

torch.optim.Muon steps whole parameters only; its per-tensor step (`_single_tensor_muon`) is given views of each
block (params, gradients and momentum buffer alike), so the arithmetic is torch's, unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _single_tensor_muon

MOMENTUM = 0.95


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups marked `muon` (each parameter with its `blocks`: (axis, number of matrices it fuses)),
    AdamW on the others."""

    def __init__(self, groups: list[dict], lr: float, betas: Optional[tuple] = None, eps: Optional[float] = None):
        defaults = dict(lr=lr, weight_decay=0.0, muon=False, momentum=MOMENTUM, nesterov=True)
        super().__init__(groups, defaults)
        adam = {k: v for k, v in (("betas", betas), ("eps", eps)) if v is not None}
        self._adamw = torch.optim.AdamW([g for g in self.param_groups if not g["muon"]], lr=lr, fused=True, **adam)
        self._link()

    def _link(self) -> None:
        """AdamW steps this optimizer's own group dicts (the schedule's lr reaches it) and keeps its state here (one
        state_dict holds both)."""
        self._adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
        self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
        self._adamw.step()
        return loss

    def _muon_step(self, group: dict) -> None:
        params, grads, buffers = [], [], []
        for param, (axis, fused) in zip(group["params"], group["blocks"]):
            if param.grad is None:
                continue
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            for tensors, whole in zip((params, grads, buffers), (param, param.grad, state["momentum_buffer"])):
                tensors.extend(whole.chunk(fused, dim=axis))  # views: torch's step updates the whole in place
        if params:
            _single_tensor_muon(
                params,
                grads,
                buffers,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                ns_coefficients=(DEFAULT_A, DEFAULT_B, DEFAULT_C),
                ns_steps=DEFAULT_NS_STEPS,
                eps=EPS,
                adjust_lr_fn="match_rms_adamw",
                has_complex=False,
            )
