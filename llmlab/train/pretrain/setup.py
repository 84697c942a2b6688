"""The pieces the pretraining loop is assembled from: accelerator, model, optimizer, data, schedule, outputs."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from accelerate.utils import GradientAccumulationPlugin

from llmlab.core.errors import UserError
from llmlab.core.io import publish_dir
from llmlab.models.gpt2 import load_pretrained_model
from llmlab.models.mup import fold_readout, hidden_matrices, lr_multipliers
from llmlab.models.registry import build_model
from llmlab.train.checkpointing import assert_finite
from llmlab.train.config import parse_clip
from llmlab.train.optim import build_optimizer as build
from llmlab.train.optim import build_schedule, check_deepspeed_choices
from llmlab.train.pretrain.config import COMPILE_MIN_STEPS
from llmlab.train.session import scaled_schedule


def accumulation_plugin(steps: int):
    """Micro-batches per optimizer step; the loop counts them itself, across epoch boundaries."""
    return GradientAccumulationPlugin(num_steps=steps, sync_with_dataloader=False)


def accumulation_steps(cfg, world: int) -> int:
    if cfg.effective_batch_size % (cfg.batch_size * world):
        raise UserError(
            f"--effective_batch_size {cfg.effective_batch_size} is not a multiple of --batch_size "
            f"{cfg.batch_size} x {world} processes; change one of them"
        )
    return cfg.effective_batch_size // (cfg.batch_size * world)


def check_deepspeed(accelerator, cfg) -> None:
    """Under DeepSpeed the clip bound lives in its config: fill it from --clip, which cannot be adaptive there."""
    ds_plugin = accelerator.state.deepspeed_plugin
    if ds_plugin is None:
        return

    check_deepspeed_choices(accelerator, cfg.optimizer, cfg.clip_mode)
    clip = parse_clip(cfg.clip)
    if clip == "adaptive":
        raise UserError(
            "--clip adaptive is not available under DeepSpeed (it clips inside its own step); "
            "pass a number, e.g. --clip 1.0"
        )
    if ds_plugin.deepspeed_config.get("gradient_clipping", "auto") == "auto":
        ds_plugin.deepspeed_config["gradient_clipping"] = float(clip)


def check_data_size(train_dl, accelerator) -> None:
    if len(train_dl) < accelerator.gradient_accumulation_steps:
        raise UserError(
            f"the training split has only {len(train_dl)} batches per process, fewer than one "
            "optimizer step; use more data or a smaller --effective_batch_size"
        )


def build_pretrain_model(cfg, tokenizer):

    if cfg.init_from:
        model = load_pretrained_model(cfg.init_from)
        if model.get_input_embeddings().num_embeddings < len(tokenizer):
            raise UserError(
                f"--init_from {cfg.init_from} has {model.get_input_embeddings().num_embeddings} "
                f"token embeddings but the tokenizer has {len(tokenizer)}; pass its own --tokenizer"
            )
    else:
        model = build_model(  # the registry the lab's probes are built by
            cfg.model,
            width=cfg.n_embd,
            depth=cfg.n_layer,
            parametrization=cfg.parametrization,
            mup_base_width=cfg.mup_base_width,
            vocab_size=len(tokenizer),
            n_head=cfg.n_head,
            dropout=cfg.dropout,
        )
    try:
        model.set_attn_implementation(cfg.attn_implementation)
    except (ValueError, ImportError) as err:  # a model transformers has no SDPA path for
        raise UserError(
            f"--attn_implementation {cfg.attn_implementation} does not work with this model "
            f"({str(err).splitlines()[0][:160]}); pass --attn_implementation eager"
        ) from None
    if cfg.gradient_checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def compile_wanted(cfg, device: torch.device) -> bool:
    """--compile as given; unset: on a GPU for a run long enough to earn the compile back (COMPILE_MIN_STEPS)."""
    if cfg.compile is not None:
        return cfg.compile
    return device.type == "cuda" and cfg.max_steps >= COMPILE_MIN_STEPS


def use_tf32(enabled: bool) -> None:
    """float32 matmuls on TF32 tensor cores (what bf16 autocast leaves in float32); a GPU-only switch."""
    if enabled and torch.cuda.is_available():
        torch.backends.cuda.matmul.fp32_precision = "tf32"


def build_optimizer(cfg, model):
    """--optimizer from the shared factory (weight decay on matrices only; Lion's lr / wd convention there), with
    muP's per-layer lr multipliers (all 1 under the standard parametrization)."""
    hf_model = model.model  # inside the loss wrapper
    multipliers, matrices = lr_multipliers(hf_model), hidden_matrices(hf_model)
    return build(
        cfg.optimizer,
        model.parameters(),
        cfg.learning_rate,
        cfg.weight_decay,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps if cfg.optimizer == "adamw" else None,
        lr_multipliers={id(p): multipliers[name] for name, p in hf_model.named_parameters()},
        matrices={id(p): matrices[name] for name, p in hf_model.named_parameters() if name in matrices},
    )


def make_scheduler(cfg, optimizer, state):
    """Linear warmup, then --lr_scheduler down to min_lr, times the run's lr scale (lowered by each rollback).
    Stepped once per optimizer step."""

    return scaled_schedule(
        build_schedule(
            optimizer,
            cfg.lr_scheduler,
            cfg.warmup_steps,
            cfg.max_steps,
            cfg.min_lr / cfg.learning_rate,
            cfg.schedule_options,
        ),
        state,
    )


def loss_scale(accelerator, optimizer) -> float | None:
    """The fp16 dynamic loss scale (None when not training in fp16)."""
    if accelerator.mixed_precision != "fp16":
        return None
    if accelerator.scaler is not None:
        return float(accelerator.scaler.get_scale())
    inner = getattr(optimizer, "optimizer", None)  # DeepSpeed's ZeRO optimizer keeps its own scaler
    scale = getattr(inner, "loss_scale", None)
    return float(scale) if scale is not None else None


def save_final(accelerator, model, tokenizer, output_dir: Path) -> Path:
    """output_dir/final: save_pretrained model + tokenizer, in fp32 whatever trained it (under DeepSpeed the fp32 master
    weights, not the 16-bit working copy), published only when complete."""

    final = output_dir / "final"
    tmp = output_dir / ".final.tmp"
    accelerator.wait_for_everyone()
    state_dict = master_state_dict(accelerator, model)  # every process must take part (ZeRO gathers its shards)
    if accelerator.is_main_process:
        hf_model = accelerator.unwrap_model(model).model  # inside the loss wrapper
        state_dict = {k.removeprefix("model."): v.float() for k, v in state_dict.items()}
        if hf_model.config.tie_word_embeddings:  # one matrix: the input embedding's (fp32 master) value is the head's
            state_dict.pop("lm_head.weight", None)
        state_dict = fold_readout(hf_model, state_dict)  # muP's readout multiplier into ln_f: a plain GPT-2
        standalone = type(hf_model)(hf_model.config).float()  # a plain fp32 copy: ties, dtype and keys as without ZeRO
        standalone.load_state_dict(state_dict, strict=False)
        standalone.tie_weights()
        assert_finite(standalone, "final model")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            standalone.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # never a half-written final/ (nor its temp folder) left behind
            raise
        publish_dir(tmp, final)
    accelerator.wait_for_everyone()
    return final


def master_state_dict(accelerator, model) -> dict:
    """The model's weights in full precision: under DeepSpeed ZeRO the optimizer's fp32 master copy (the module holds
    16-bit weights), else the module's own."""
    state = accelerator.get_state_dict(model)
    if accelerator.state.deepspeed_plugin is None:
        return state
    from deepspeed.utils import safe_get_full_fp32_param  # deepspeed is imported only when a launch uses it

    unwrapped = accelerator.unwrap_model(model)
    for name, param in unwrapped.named_parameters():
        master = safe_get_full_fp32_param(param)
        if master is not None:
            state[name] = master.detach().cpu()
    return state
