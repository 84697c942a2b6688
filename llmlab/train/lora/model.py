"""LoRA plumbing shared by train_lora.py and the benchmarks: base model + tokenizer, the adapter, and its
saving: the best adapter as a peft folder, and adapter-only training checkpoints (accelerate hooks) so a
resumable checkpoint of a LoRA run weighs megabytes, not the whole base model.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Optional

from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmlab.core.errors import UserError
from llmlab.core.identity import BASE_RECORD
from llmlab.core.io import atomic_write_json, publish_dir
from llmlab.data.instruct import PROMPT_FILE
from llmlab.data.tokenizer import load_tokenizer
from llmlab.train.lora.config import ALL_LINEAR, check_base_model


def load_base_model(cfg):
    """(model, tokenizer, whether the tokenizer came from the base model's folder).

    A missing default model is a one-line hint, not a traceback."""
    check_base_model(cfg)
    try:
        model = AutoModelForCausalLM.from_pretrained(cfg.base_model)
    except (OSError, ValueError) as err:
        raise UserError(
            f"cannot load --base_model {cfg.base_model!r} ({str(err).strip().splitlines()[0][:160]}); "
            "pass a save_pretrained folder, or a hub name when online"
        ) from None
    from_base = False
    if cfg.tokenizer:
        tokenizer = load_tokenizer(cfg.tokenizer)
    else:
        try:
            tokenizer, from_base = AutoTokenizer.from_pretrained(cfg.base_model), True
        except (OSError, ValueError, TypeError):
            if model.config.vocab_size != 50257:
                raise UserError(f"--base_model {cfg.base_model!r} has no tokenizer files; pass --tokenizer") from None
            tokenizer = load_tokenizer()  # a GPT-2-vocab model saved without its tokenizer
    if tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has no eos token; answers need one to teach the model to stop")
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        raise UserError(
            f"tokenizer has {len(tokenizer)} tokens but the model only {model.config.vocab_size}; "
            "pass the model's own tokenizer with --tokenizer"
        )
    return model, tokenizer, from_base


def add_lora(model, cfg):
    """Wrap `model` with a LoRA adapter; afterwards only adapter weights require grad."""
    if cfg.gradient_checkpointing:
        # Frozen embeddings would give the checkpointed blocks inputs without grad, and no grad would
        # reach the adapters inside them: make the embedding output require grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        model.config.use_cache = False
    # peft notices GPT-2's Conv1D layers itself (sets fan_in_fan_out) and says so; transformers 5 warns
    # about an attribute peft still reads. Neither is actionable by the user.
    warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False")
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    lora_config = LoraConfig(
        task_type="CAUSAL_LM",
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=ALL_LINEAR if cfg.target_modules == [ALL_LINEAR] else cfg.target_modules,
    )
    try:
        return get_peft_model(model, lora_config)
    except ValueError as err:  # unknown model type without --target_modules, or names that match nothing
        raise UserError(
            f"cannot place LoRA adapters ({str(err).strip().splitlines()[0][:160]}); "
            "set --target_modules to the attention projections of this model"
        ) from None


def adapter_state(model) -> dict:
    """A CPU copy of the adapter weights (kept in memory as the best-so-far adapter)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(model).items()}


def save_adapter(model, cfg, path: Path, tokenizer=None, base_digest: Optional[str] = None) -> None:
    """peft save_pretrained into a temp folder, then swapped into place: never a half-written adapter.

    `tokenizer` is saved alongside only when it is not the base model's own (which inference finds there). The base
    model's identity is recorded (llmlab.core.identity.BASE_RECORD), so a merge can check it gets the same base.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        atomic_write_json(
            tmp / PROMPT_FILE,
            {
                "prompt_template": cfg.prompt_template,
                "prompt_template_no_input": cfg.prompt_template_no_input,
                "eos_after_answer": True,
            },
        )
        if base_digest:
            atomic_write_json(tmp / BASE_RECORD, {"base_model": cfg.base_model, "digest": base_digest})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, path)


TRAINABLE_FILE = "trainable_weights.safetensors"
BEST_ADAPTER_FILE = "best_adapter.safetensors"


def checkpoint_trainable_weights_only(accelerator) -> None:
    """Make accelerator.save_state/load_state keep only the trainable (adapter) weights of the model.

    The frozen base is rebuilt from --base_model on resume; writing it into every checkpoint would cost the
    whole model's size each time. Optimizer, scheduler and RNG states are still accelerate's to save."""

    def trainable(model) -> dict:
        return {n: p for n, p in accelerator.unwrap_model(model).named_parameters() if p.requires_grad}

    def save_hook(models, weights, output_dir):
        (model,) = models
        if accelerator.is_main_process:
            save_file(
                {n: p.detach().cpu().contiguous() for n, p in trainable(model).items()},
                os.path.join(output_dir, TRAINABLE_FILE),
            )
        weights.clear()  # nothing left for accelerate to write as the model

    def load_hook(models, input_dir):
        (model,) = models
        saved = load_file(os.path.join(input_dir, TRAINABLE_FILE))
        if set(saved) != set(trainable(model)):
            raise UserError(
                f"checkpoint {input_dir} holds other adapter weights than this run builds; resume with "
                "the --base_model, --lora_r and --target_modules it was written with"
            )
        accelerator.unwrap_model(model).load_state_dict(saved, strict=False)
        models.clear()  # loaded: accelerate must not look for a full model file

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
