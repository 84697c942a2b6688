"""The minimal Transformer of the methodology lab: small enough to sweep on CPU, real 50257-token vocabulary.

Width 192, 4 causal blocks, 6 heads of 32, feed-forward 384 with GELU, no biases anywhere, LayerNorms with a
gain only. The token embedding is tied to the output head (GPT-2's choice) and trains by default: with it
frozen -- the lab's original design, kept as `embedding="frozen"` -- the probe stays within half a nat of the
uniform guess at the CPU budget and every comparison drowns in that (README, "the methodology lab").
Position encoding: RoPE (default), learned, sinusoidal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class MinimalTransformerConfig:
    vocab_size: int = 50257
    width: int = 192
    n_layer: int = 4
    n_head: int = 6
    ff_width: int = 384
    max_seq_len: int = 1024
    # rope by default: the sinusoidal table is added at unit amplitude to token embeddings of std 0.02, so the
    # residual stream is ~35x position, and at the CPU budget attention never leaves uniform (README)
    position_encoding: Literal["sinusoidal", "learned", "rope"] = "rope"
    # trainable: the token embedding learns (tied to the output head, as in GPT-2). frozen: the original lab
    # design, a fixed random embedding; at the CPU budget that probe never gets below ~10.2 nats (README).
    embedding: Literal["trainable", "frozen"] = "trainable"
    # muP (Yang et al., "Tensor Programs V"): hidden matrices get init std and Adam lr scaled by 1/width_mult and
    # the (tied) readout 1/width_mult, so the best lr stays put as the width grows; equal to standard at base_width.
    parametrization: Literal["standard", "mup"] = "standard"
    mup_base_width: int = 192
    gradient_checkpointing: bool = False

    @property
    def width_mult(self) -> float:
        return self.width / self.mup_base_width if self.parametrization == "mup" else 1.0

    @staticmethod
    def of_size(width: int | None, n_layer: int | None, head_dim: int = 32, **kwargs) -> "MinimalTransformerConfig":
        """The family the lab scans: heads of 32 (or head_dim), feed-forward 2 x width. No width: the default shape
        (192 wide, 4 deep), as a trial that names no size trains."""
        if not width:
            return MinimalTransformerConfig(**kwargs)
        return MinimalTransformerConfig(
            width=width, n_layer=n_layer, n_head=width // head_dim, ff_width=2 * width, **kwargs
        )


def sinusoidal_table(length: int, width: int) -> torch.Tensor:
    position = torch.arange(length, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(10000.0) / width))
    table = torch.zeros(length, width)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    return table


def rope_tables(length: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (even, odd) channel pairs of x [batch, head, seq, head_dim] by the position angle."""
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[: x.size(-2)].to(x.dtype), sin[: x.size(-2)].to(x.dtype)
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: MinimalTransformerConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=False)

    def forward(self, x, rope=None, return_entropy: bool = False):
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        entropy = None
        if return_entropy:  # explicit softmax so the attention distribution can be measured
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
            mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
            probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            p32 = probs.float()  # 1e-12 underflows in fp16, and 0 * log(0) would be NaN
            entropy = -(p32 * p32.clamp_min(1e-12).log()).sum(-1).mean()
            y = probs @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width)), entropy


class Block(nn.Module):
    def __init__(self, cfg: MinimalTransformerConfig):
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.width, bias=False)
        self.attn = CausalSelfAttention(cfg)
        self.ln_ff = nn.LayerNorm(cfg.width, bias=False)
        self.ff_in = nn.Linear(cfg.width, cfg.ff_width, bias=False)
        self.ff_out = nn.Linear(cfg.ff_width, cfg.width, bias=False)

    def forward(self, x, rope=None, return_entropy: bool = False):
        attended, entropy = self.attn(self.ln_attn(x), rope, return_entropy)
        x = x + attended
        x = x + self.ff_out(F.gelu(self.ff_in(self.ln_ff(x))))
        return x, entropy


class MinimalTransformer(nn.Module):
    def __init__(self, cfg: MinimalTransformerConfig):
        super().__init__()
        if cfg.width % cfg.n_head:
            raise ValueError(f"width {cfg.width} is not divisible by n_head {cfg.n_head}")
        self.cfg = cfg
        if cfg.embedding not in ("trainable", "frozen"):
            raise ValueError(f"unknown embedding mode {cfg.embedding!r}")
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.width)  # shared with the output head
        self.token_embedding.weight.requires_grad_(cfg.embedding == "trainable")
        self.position_embedding = None
        if cfg.position_encoding == "learned":
            self.position_embedding = nn.Embedding(cfg.max_seq_len, cfg.width)
        elif cfg.position_encoding == "sinusoidal":
            self.register_buffer("sinusoid", sinusoidal_table(cfg.max_seq_len, cfg.width), persistent=False)
        elif cfg.position_encoding == "rope":
            cos, sin = rope_tables(cfg.max_seq_len, cfg.width // cfg.n_head)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        else:
            raise ValueError(f"unknown position encoding {cfg.position_encoding!r}")
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_final = nn.LayerNorm(cfg.width, bias=False)
        self.apply(self._init_weights)
        hidden_std = 0.02 / math.sqrt(cfg.width_mult)  # muP: hidden weights ~ 1/sqrt(fan_in); = 0.02 at base width
        for block in self.blocks:
            if cfg.width_mult != 1.0:  # (not redrawn otherwise: the same seed gives the same model as before)
                for layer in (block.attn.qkv, block.ff_in):
                    nn.init.normal_(layer.weight, std=hidden_std)
            for layer in (block.attn.proj, block.ff_out):  # GPT-2's scaled init of the residual projections
                nn.init.normal_(layer.weight, std=hidden_std / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, return_attention_entropy: bool = False):
        """Logits [batch, seq, vocab]; with `return_attention_entropy`, also the last block's mean entropy."""
        seq = input_ids.size(1)
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {seq} tokens exceeds max_seq_len {self.cfg.max_seq_len}")
        x = self.token_embedding(input_ids)
        rope = None
        if self.position_embedding is not None:
            x = x + self.position_embedding(torch.arange(seq, device=input_ids.device))
        elif self.cfg.position_encoding == "sinusoidal":
            x = x + self.sinusoid[:seq].to(x.dtype)
        else:
            rope = (self.rope_cos, self.rope_sin)
        entropy = None
        for index, block in enumerate(self.blocks):
            last = index == len(self.blocks) - 1
            want_entropy = return_attention_entropy and last
            if self.cfg.gradient_checkpointing and self.training and not want_entropy:
                x, _ = checkpoint(block, x, rope, False, use_reentrant=False)
            else:
                x, entropy_here = block(x, rope, want_entropy)
                entropy = entropy_here if want_entropy else entropy
        logits = F.linear(self.ln_final(x), self.token_embedding.weight)  # tied head
        if self.cfg.width_mult != 1.0:  # muP's readout multiplier (MuSharedReadout for a tied head)
            logits = logits / self.cfg.width_mult
        return (logits, entropy) if return_attention_entropy else logits

    HIDDEN = ("attn.qkv.weight", "attn.proj.weight", "ff_in.weight", "ff_out.weight")

    def lr_multipliers(self) -> dict[str, float]:
        """Per-parameter Adam lr multipliers: muP scales hidden matrices by 1/width_mult; 1 everywhere otherwise."""
        return {
            name: (1 / self.cfg.width_mult if name.endswith(self.HIDDEN) else 1.0)
            for name, _ in self.named_parameters()
        }

    def hidden_matrices(self) -> dict[str, tuple[int, int]]:
        """name -> (axis, matrices it holds along that axis) of each hidden matrix: qkv ([3 width, width]) is Q, K and
        V stacked along its rows."""
        return {
            name: ((0, 3) if name.endswith("attn.qkv.weight") else (0, 1))
            for name, _ in self.named_parameters()
            if name.endswith(self.HIDDEN)
        }

    def non_embedding_parameters(self) -> int:
        """N of the scaling-law papers: every parameter but the token (and learned position) embeddings."""
        skip = ("token_embedding.weight", "position_embedding.weight")
        return sum(p.numel() for name, p in self.named_parameters() if name not in skip)


def parameter_table(model: nn.Module) -> tuple[str, int, int]:
    """A per-module table of trainable vs frozen parameter counts; returns (text, trainable, frozen)."""
    rows: dict[str, list[int]] = {}
    for name, param in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        counts = rows.setdefault(module, [0, 0])
        counts[0 if param.requires_grad else 1] += param.numel()
    trainable = sum(c[0] for c in rows.values())
    frozen = sum(c[1] for c in rows.values())
    width = max([len("module")] + [len(m) for m in rows])
    lines = [f"{'module':<{width}}  {'trainable':>11}  {'frozen':>11}"]
    lines += [f"{m:<{width}}  {t:>11,}  {f:>11,}" for m, (t, f) in rows.items()]
    lines.append(f"{'TOTAL':<{width}}  {trainable:>11,}  {frozen:>11,}")
    return "\n".join(lines), trainable, frozen


def expected_trainable_parameters(cfg: MinimalTransformerConfig) -> int:
    """Closed form of the trainable count: 4 matrices per block + LayerNorm gains (+ learned positions, + the
    tied embedding when it trains)."""
    per_block = 3 * cfg.width * cfg.width + cfg.width * cfg.width + 2 * cfg.width * cfg.ff_width + 2 * cfg.width
    positions = cfg.max_seq_len * cfg.width if cfg.position_encoding == "learned" else 0
    embedding = cfg.vocab_size * cfg.width if cfg.embedding == "trainable" else 0
    return cfg.n_layer * per_block + cfg.width + positions + embedding
