"""GPT-2 models: named presets built from GPT2Config, or any HF causal-LM name/path via --init_from.

Presets are GPT-2 shapes; only `gpt2-tiny` is ours: small enough that a few hundred steps on two CPU
cores visibly lower the loss on real text, yet with the real 50257-token vocabulary, so every tool in the
project (tokenizer, LoRA, merge, inference) runs on it unchanged.
"""

from __future__ import annotations

from typing import Any

from llmlab.core.errors import UserError

GPT2_PRESETS: dict[str, dict[str, int]] = {
    "gpt2-tiny": {"n_layer": 4, "n_embd": 256, "n_head": 4, "n_positions": 256},
    "gpt2": {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024},  # 124M
    "gpt2-medium": {"n_layer": 24, "n_embd": 1024, "n_head": 16, "n_positions": 1024},  # 355M
}


def gpt2_config(preset: str, vocab_size: int = 50257, n_positions: int | None = None, **overrides: Any):
    """The GPT2Config of a preset; `overrides` (e.g. n_layer=2) reshape it, for tests and sweeps."""
    from transformers import GPT2Config

    if preset not in GPT2_PRESETS:
        raise UserError(
            f"unknown model preset {preset!r}; choose one of {', '.join(GPT2_PRESETS)} "
            "or pass a Hugging Face model name/path with --init_from"
        )
    shape = {**GPT2_PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
    if n_positions is not None:
        shape["n_positions"] = n_positions
    if shape["n_embd"] % shape["n_head"]:
        raise UserError(f"n_embd ({shape['n_embd']}) must be divisible by n_head ({shape['n_head']})")
    eos = vocab_size - 1 if vocab_size == 50257 else None  # GPT-2's <|endoftext|>
    # GPT-2's tanh-approximated GELU as one fused op: the same function as its "gelu_new", whose six elementwise
    # Python ops each keep a [tokens x 4 width] tensor for backward (bench/loss_memory.py measures the difference).
    shape.setdefault("activation_function", "gelu_pytorch_tanh")
    return GPT2Config(vocab_size=vocab_size, bos_token_id=eos, eos_token_id=eos, **shape)


PARAMETRIZATIONS = ("standard", "mup")


def build_gpt2_model(
    preset: str,
    vocab_size: int = 50257,
    n_positions: int | None = None,
    parametrization: str = "standard",
    mup_base_width: int = 128,
    dropout: float = 0.0,
    **overrides: Any,
):
    """A randomly initialised GPT2LMHeadModel of the named preset (seed torch first for reproducibility), the one
    builder of the trainers and the lab's GPT-2 probes. `dropout` sets all three of GPT-2's dropouts (0, as
    pretraining usually runs, not GPT2Config's 0.1). With `parametrization="mup"`, muP's init and readout at width
    multiplier n_embd / mup_base_width (models/mup.py)."""
    from transformers import GPT2LMHeadModel

    drop = {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
    model = GPT2LMHeadModel(gpt2_config(preset, vocab_size, n_positions, **drop, **overrides))
    if parametrization == "mup":
        from llmlab.models.mup import apply_mup

        apply_mup(model, mup_base_width)
    elif parametrization != "standard":
        raise UserError(f"unknown parametrization {parametrization!r}; choose one of {', '.join(PARAMETRIZATIONS)}")
    return model


def load_pretrained_model(name_or_path: str):
    """Any HF causal LM by hub name or local folder (offline: a folder, or a model already in the cache)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(name_or_path)
    except (OSError, ValueError) as err:
        raise UserError(
            f"cannot load model {name_or_path!r} for --init_from ({str(err).splitlines()[0][:160]}); "
            "pass a folder written by save_pretrained, or a hub name when online"
        ) from None


def context_length_of(name_or_path: str) -> int:
    """The context length a saved or hub model was built for, read from its config alone (no weights)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as err:
        raise UserError(
            f"cannot load the model config of {name_or_path!r} ({str(err).splitlines()[0][:160]}); "
            "pass a folder written by save_pretrained, or a hub name when online"
        ) from None
    return config.max_position_embeddings
