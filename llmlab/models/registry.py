"""Every model the trainers and the lab build, one registry entry each: how to build it at a width and depth, and
what a study needs to know of it: its non-embedding N, the parametrisations it has, its head size as it widens, and
its training FLOPs per token.

The trainers (`train_pretrain.py`), the lab's trials (`sweep/trial.py`) and the scaling study's sizes
(`scaling/scan.py`) all build through `build_model`, so a probe is the model a user trains, built by the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from llmlab.core.errors import UserError
from llmlab.models.flops import flops_per_token
from llmlab.models.gpt2 import GPT2_PRESETS, PARAMETRIZATIONS, build_gpt2_model
from llmlab.models.minimal import MinimalTransformer, MinimalTransformerConfig


@dataclass(frozen=True)
class ModelEntry:
    name: str
    family: str  # "gpt2" (Hugging Face GPT-2: learned positions, biases, feed-forward 4x) or "minimal"
    head_dim: Optional[int]  # the head size a probe keeps as it widens (None: the scan's --head_dim)
    build: Callable  # build(width, depth, seq_len, parametrization, mup_base_width, head_dim, **options)
    summary: str
    parametrizations: tuple[str, ...] = PARAMETRIZATIONS

    def probe_head_dim(self, requested: Optional[int]) -> Optional[int]:
        """A probe's head size: the entry's own where it fixes one (GPT-2's 64), else the requested one."""
        return self.head_dim or requested


def _gpt2(preset: str):
    def build(width, depth, seq_len, parametrization, mup_base_width, head_dim=None, **options):
        # `head_dim` (a probe's 64): heads of that size as it widens; else --n_head, else the preset's own heads
        n_head = options.pop("n_head", None) or (width // head_dim if width and head_dim else None)
        return build_gpt2_model(
            preset,
            vocab_size=options.pop("vocab_size", 50257),
            n_positions=seq_len,
            parametrization=parametrization,
            mup_base_width=mup_base_width,
            dropout=options.pop("dropout", 0.0),
            n_embd=width,
            n_layer=depth,
            n_head=n_head,
            **options,
        )

    return build


def _minimal(width, depth, seq_len, parametrization, mup_base_width, head_dim=32, **options):
    shape = dict(parametrization=parametrization, mup_base_width=mup_base_width, **options)
    if seq_len is not None:
        shape["max_seq_len"] = seq_len
    return MinimalTransformer(MinimalTransformerConfig.of_size(width, depth, head_dim, **shape))


MODELS: dict[str, ModelEntry] = {
    name: ModelEntry(name, "gpt2", 64, _gpt2(name), f"GPT-2 preset ({shape['n_layer']} x {shape['n_embd']})")
    for name, shape in GPT2_PRESETS.items()
} | {
    "minimal": ModelEntry(
        "minimal", "minimal", None, _minimal, "the lab's minimal Transformer (RoPE, no biases, feed-forward 2x)"
    )
}


def build_model(
    name: str,
    width: Optional[int] = None,
    depth: Optional[int] = None,
    seq_len: Optional[int] = None,
    parametrization: str = "standard",
    mup_base_width: int = 128,
    **options,
):
    """A randomly initialised model (seed torch first) of a registered name; `width`/`depth` reshape it (None: the
    entry's own shape), `seq_len` sets its positions (None: the preset's)."""
    entry = MODELS.get(name)
    if entry is None:
        raise UserError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if parametrization not in entry.parametrizations:
        raise UserError(f"{name} has no {parametrization!r} parametrization; choose one of {entry.parametrizations}")
    return entry.build(width, depth, seq_len, parametrization, mup_base_width, **options)


def non_embedding_parameters(model) -> int:
    """N as the scaling-law papers count it: all parameters but token and position embeddings."""
    if hasattr(model, "non_embedding_parameters"):
        return model.non_embedding_parameters()
    return model.num_parameters(exclude_embeddings=True)  # drops every nn.Embedding: GPT-2's wte and wpe


def model_facts(name: str, width: Optional[int], depth: Optional[int], seq_len: int, **options) -> dict:
    """What a study needs of a model without building it: built on the meta device (no memory, no time), a probe's
    heads at its entry's size as it widens (models.registry.ModelEntry.probe_head_dim)."""
    entry = MODELS.get(name)
    head_dim = entry.probe_head_dim(options.pop("head_dim", None)) if entry else None
    with torch.device("meta"):
        model = build_model(name, width, depth, seq_len, **options, **({"head_dim": head_dim} if head_dim else {}))
    return {
        "non_embedding": non_embedding_parameters(model),
        "total": sum(p.numel() for p in model.parameters()),
        "flops_per_token": flops_per_token(model, seq_len),
        "parametrizations": MODELS[name].parametrizations,
    }
