"""The GPU fast path's switches, checked on a CPU: what each one picks, and that it leaves the model's function alone
(bench/gpu_throughput.py --ablate measures what each is worth on a GPU)."""

from __future__ import annotations

import pytest
import torch

from llmlab.core.config import parse_config
from llmlab.train.batches import make_dataloaders
from llmlab.train.engine import skips_on_device
from llmlab.train.optim import build_optimizer
from llmlab.train.pretrain import setup
from llmlab.train.pretrain.config import COMPILE_MIN_STEPS, PretrainConfig
from tests.conftest import tiny_pretrain_args


def config(*extra: str) -> PretrainConfig:
    return parse_config(PretrainConfig, [*tiny_pretrain_args(), "--output_dir", "/tmp/unused", *extra])


def test_compile_defaults_to_a_gpu_run_long_enough_to_earn_it_back():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    long_run, short_run = config("--max_steps", str(COMPILE_MIN_STEPS)), config("--max_steps", "20")
    assert setup.compile_wanted(long_run, cuda) and not setup.compile_wanted(short_run, cuda)
    assert not setup.compile_wanted(long_run, cpu)  # a CPU compiles only when asked
    assert setup.compile_wanted(config("--compile", "--max_steps", "20"), cpu)
    assert not setup.compile_wanted(config("--no-compile", "--max_steps", str(COMPILE_MIN_STEPS)), cuda)


def test_sdpa_and_eager_attention_compute_the_same_loss():
    from llmlab.data.tokenizer import load_tokenizer
    from llmlab.train.loss import CausalLMWithLoss

    tokenizer, ids = load_tokenizer(), torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = {}
    for kind in ("sdpa", "eager"):
        torch.manual_seed(0)
        model = setup.build_pretrain_model(config("--attn_implementation", kind), tokenizer)
        assert model.config._attn_implementation == kind
        with torch.no_grad():
            losses[kind] = float(CausalLMWithLoss(model)(ids))
    assert losses["sdpa"] == pytest.approx(losses["eager"], rel=1e-5)


def test_pinned_batches_and_tf32_are_gpu_only_switches():
    from datasets import Dataset

    class Data:  # the two splits make_dataloaders reads
        train = validation = Dataset.from_dict({"input_ids": [[1, 2, 3]] * 4})

    train, _ = make_dataloaders(config(), Data)
    assert train.pin_memory is torch.cuda.is_available()  # page-locked memory only where a GPU copies from it
    before = torch.backends.cuda.matmul.fp32_precision
    setup.use_tf32(True)
    assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if torch.cuda.is_available() else before)


def test_fused_adamw_is_the_default_and_the_only_one_that_skips_on_the_device():
    model = torch.nn.Linear(4, 4)
    fused, foreach = (build_optimizer(name, model.parameters(), 1e-3, 0.1) for name in ("adamw", "adamw-foreach"))
    assert fused.defaults["fused"] and not foreach.defaults["fused"] and foreach.defaults["foreach"]
    assert skips_on_device(fused) and not skips_on_device(foreach)
    assert config().optimizer == "adamw"


def test_a_model_without_the_attention_kernel_is_one_line(monkeypatch):
    from transformers import GPT2LMHeadModel

    from llmlab.core.errors import UserError
    from llmlab.data.tokenizer import load_tokenizer

    def refuse(self, name):
        raise ValueError(f"{type(self).__name__} does not support an attention implementation through {name}\nmore")

    monkeypatch.setattr(GPT2LMHeadModel, "set_attn_implementation", refuse)
    with pytest.raises(UserError, match="--attn_implementation sdpa does not work with this model .*; pass "):
        setup.build_pretrain_model(config(), load_tokenizer())
