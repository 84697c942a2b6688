"""The coordinate check of muP (Yang et al. 2022, "Tensor Programs V", section 8; the `mup` package's coord_check),
through the trainer's own model and optimizer builders (llmlab/train/pretrain/setup.py).

At each width, train a few AdamW steps on real tokens and record, in each step's forward, the RMS of every block's
attention output, MLP output and residual stream, and of the logits. Under muP every one of them stays O(1) as the
width grows: ln RMS has slope ~0 in ln width. Under the standard parametrization the updates of the hidden matrices
and of the readout add up over the width, so after the first step the attention and the logits grow with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from llmlab.data.corpus import iter_documents
from llmlab.data.tokenizer import load_tokenizer
from llmlab.train.loss import CausalLMWithLoss
from llmlab.train.pretrain import setup
from llmlab.train.pretrain.config import PretrainConfig

RECORDED = ("attn", "mlp", "residual", "logits")  # per block for the first three (averaged over blocks)


@dataclass(frozen=True)
class CoordCheck:
    widths: tuple[int, ...] = (64, 128, 256, 512, 1024)
    depth: int = 2
    steps: int = 5  # forwards recorded: step 1 is the initial model, step t has seen t - 1 updates
    batch: int = 4
    seq: int = 64
    lr: float = 1e-2  # large, as the coordinate check uses: a wrong parametrization shows up within a few steps
    base_width: int = 64
    seeds: tuple[int, ...] = (0, 1)


def token_batches(cfg: CoordCheck, tokenizer) -> torch.Tensor:
    """[steps, batch, seq] real tokens: the first documents of the built-in Wikipedia sample, in order."""
    need, ids = cfg.steps * cfg.batch * cfg.seq, []
    for text in iter_documents("builtin:wiki", None, "text"):
        ids += tokenizer(text).input_ids
        if len(ids) >= need:
            break
    return torch.tensor(ids[:need]).view(cfg.steps, cfg.batch, cfg.seq)


def model_config(width: int, parametrization: str, cfg: CoordCheck) -> PretrainConfig:
    """The trainer's options for one width: heads of 64 (GPT-2's), dropout 0, AdamW without weight decay."""
    return PretrainConfig(
        model="gpt2-tiny",
        n_layer=cfg.depth,
        n_embd=width,
        n_head=max(1, width // 64),
        parametrization=parametrization,
        mup_base_width=cfg.base_width,
        learning_rate=cfg.lr,
        weight_decay=0.0,
        attn_implementation="eager",  # the same kernel at every width and on every CPU
    )


def _rms(tensor: torch.Tensor) -> float:
    return float(tensor.detach().float().pow(2).mean().sqrt())


def measure_width(width: int, parametrization: str, cfg: CoordCheck, batches: torch.Tensor, tokenizer, seed: int):
    """Rows {width, step, what, rms} for one width and seed: the forward of each of cfg.steps AdamW steps."""
    torch.manual_seed(seed)
    options = model_config(width, parametrization, cfg)
    hf_model = setup.build_pretrain_model(options, tokenizer)
    model = CausalLMWithLoss(hf_model, 0.0, 0)  # full logits: the logits are one of the recorded coordinates
    optimizer = setup.build_optimizer(options, model)
    seen: dict[str, list[float]] = {}

    def keep(name):
        def hook(module, args, output):
            seen.setdefault(name, []).append(_rms(output[0] if isinstance(output, tuple) else output))

        return hook

    handles = []
    for block in hf_model.transformer.h:
        handles += [
            block.attn.register_forward_hook(keep("attn")),
            block.mlp.register_forward_hook(keep("mlp")),
            block.register_forward_hook(keep("residual")),
        ]
    handles.append(hf_model.lm_head.register_forward_hook(keep("logits")))
    rows = []
    model.train()
    for step, input_ids in enumerate(batches, start=1):
        seen.clear()
        loss = model(input_ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        rows += [
            {"width": width, "seed": seed, "step": step, "what": what, "rms": float(np.mean(seen[what]))}
            for what in RECORDED
        ]
    for handle in handles:
        handle.remove()
    return rows


def run_coord_check(cfg: CoordCheck, parametrizations=("standard", "mup"), tokenizer=None) -> list[dict]:
    """Every (parametrization, width, seed, step, coordinate) RMS, in that order."""
    tokenizer = tokenizer or load_tokenizer()
    batches = token_batches(cfg, tokenizer)
    rows = []
    for parametrization in parametrizations:
        for width in cfg.widths:
            for seed in cfg.seeds:
                rows += [
                    {"parametrization": parametrization, **row}
                    for row in measure_width(width, parametrization, cfg, batches, tokenizer, seed)
                ]
    return rows


def slopes(rows: list[dict]) -> list[dict]:
    """The least-squares slope of ln RMS (mean over seeds) on ln width, per parametrization, step and coordinate."""
    groups: dict[tuple, dict[int, list[float]]] = {}
    for row in rows:
        key = (row["parametrization"], row["step"], row["what"])
        groups.setdefault(key, {}).setdefault(row["width"], []).append(row["rms"])
    out = []
    for (parametrization, step, what), by_width in groups.items():
        widths = sorted(by_width)
        x = np.log(widths)
        y = np.log([np.mean(by_width[w]) for w in widths])
        slope = float(np.polyfit(x, y, 1)[0]) if len(widths) > 1 else math.nan
        out.append({"parametrization": parametrization, "step": step, "what": what, "slope": slope})
    return out
