"""The minimal Transformer: the spec's parameter budget, tied head (trainable or frozen), causality per position
encoding."""

import math

import pytest
import torch

from llmlab.models.minimal import (
    MinimalTransformer,
    MinimalTransformerConfig,
    expected_trainable_parameters,
    parameter_table,
)
from llmlab.train.loss import causal_lm_loss

SPEC_TRAINABLE = 1_181_376  # 4 x (4*192^2 + 2*192*384 + 2*192) + 192


def small(pe="sinusoidal", **kw):
    torch.manual_seed(0)
    return MinimalTransformer(MinimalTransformerConfig(max_seq_len=32, position_encoding=pe, **kw))


def test_parameter_table_matches_the_spec():
    model = small(embedding="frozen")  # the original lab design: everything but the embedding trains
    table, trainable, frozen = parameter_table(model)
    assert trainable == SPEC_TRAINABLE == expected_trainable_parameters(model.cfg)
    assert frozen == 50257 * 192
    assert "token_embedding" in table and "TOTAL" in table and "1,181,376" in table
    learned = small("learned", embedding="frozen")
    assert parameter_table(learned)[1] == SPEC_TRAINABLE + 32 * 192 == expected_trainable_parameters(learned.cfg)
    # no biases anywhere; LayerNorms hold only a gain
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]
    assert all(p.ndim == 1 for n, p in model.named_parameters() if ".ln" in n or n.startswith("ln_"))


def test_embedding_is_frozen_and_tied_to_the_head():
    model = small(embedding="frozen")
    ids = torch.randint(100, 50257, (2, 16))
    logits = model(ids)
    loss = causal_lm_loss(logits, ids)
    loss.backward()
    assert model.token_embedding.weight.grad is None
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with torch.no_grad():  # the head is the embedding matrix: doubling row 7 doubles exactly logit 7
        model.token_embedding.weight[7].mul_(2)
        again = model(ids)
    assert torch.allclose(again[..., 7], 2 * logits[..., 7].detach(), atol=1e-5)
    assert torch.allclose(again[..., 8], logits[..., 8].detach(), atol=1e-6)
    assert abs(loss.item() - math.log(50257)) < 0.3  # an untrained model is close to uniform


@pytest.mark.parametrize("pe", ["sinusoidal", "learned", "rope"])
def test_causal_for_every_position_encoding(pe):
    model = small(pe).eval()
    ids = torch.randint(0, 50257, (1, 20))
    changed = ids.clone()
    changed[0, 12] = (changed[0, 12] + 1) % 50257
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-5)
    assert not torch.allclose(a[:, 12:], b[:, 12:], atol=1e-5)


def test_positions_matter_and_entropy_is_a_distribution_entropy():
    model = small("sinusoidal").eval()
    same = torch.full((1, 16), 42)
    with torch.no_grad():  # identical tokens: only the position encoding can tell the outputs apart
        logits = model(same)
    assert not torch.allclose(logits[0, 3], logits[0, 9], atol=1e-5)
    model = small("rope").eval()
    ids = torch.randint(0, 50257, (1, 16))
    with torch.no_grad():
        logits, entropy = model(ids, return_attention_entropy=True)
        plain = model(ids)
    assert 0 < float(entropy) <= math.log(16)
    assert torch.allclose(plain, logits, atol=1e-4)  # explicit softmax path == SDPA path


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(0, 50257, (2, 16))
    grads = []
    for ckpt in (False, True):
        model = small(gradient_checkpointing=ckpt)
        causal_lm_loss(model(ids), ids).backward()
        grads.append(model.blocks[0].attn.qkv.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_default_embedding_trains_and_stays_tied_to_the_head():
    model = small()
    _, trainable, frozen = parameter_table(model)
    assert frozen == 0 and trainable == SPEC_TRAINABLE + 50257 * 192 == expected_trainable_parameters(model.cfg)
    ids = torch.randint(100, 50257, (2, 16))
    causal_lm_loss(model(ids), ids).backward()
    grad = model.token_embedding.weight.grad
    # both uses reach the one matrix: rows of tokens in the input get input gradients, every row gets head ones
    assert grad is not None and bool((grad != 0).all())
    with torch.no_grad():
        model.token_embedding.weight[7].mul_(2)  # the head is still the embedding matrix
        assert model(ids)[..., 7].abs().sum() > 0


def test_mup_equals_standard_at_base_width_and_scales_lr_readout_and_init_with_width():
    from llmlab.models.minimal import MinimalTransformerConfig as Config
    from llmlab.train.optim import build_optimizer

    torch.manual_seed(0)
    standard = MinimalTransformer(Config.of_size(128, 2, max_seq_len=16))
    torch.manual_seed(0)
    base = MinimalTransformer(Config.of_size(128, 2, max_seq_len=16, parametrization="mup", mup_base_width=128))
    assert all(torch.equal(a, b) for a, b in zip(standard.parameters(), base.parameters()))
    wide = MinimalTransformer(Config.of_size(512, 2, max_seq_len=16, parametrization="mup", mup_base_width=128))
    multipliers = wide.lr_multipliers()
    assert multipliers["blocks.0.attn.qkv.weight"] == multipliers["blocks.1.ff_out.weight"] == 0.25
    assert multipliers["token_embedding.weight"] == multipliers["blocks.0.ln_attn.weight"] == 1.0
    # hidden init shrinks as 1/sqrt(width_mult): 0.02 / 2 at 4x the base width
    assert abs(float(wide.blocks[0].attn.qkv.weight.std()) - 0.01) < 0.001
    optimizer = build_optimizer(
        "adamw",
        list(wide.parameters()),
        1e-3,
        0.01,
        lr_multipliers={id(p): multipliers[n] for n, p in wide.named_parameters()},
    )
    lrs = sorted({(g["lr"], g["weight_decay"]) for g in optimizer.param_groups})
    assert lrs == [(2.5e-4, 0.01), (1e-3, 0.0), (1e-3, 0.01)]
    assert optimizer.param_groups[0]["lr"] == 1e-3  # the lr the curves record is the one the user set
    ids = torch.randint(0, 50257, (1, 8))
    with torch.no_grad():  # the readout divides the tied head's logits by width_mult
        hidden = wide.ln_final(
            wide.blocks[1](
                wide.blocks[0](wide.token_embedding(ids), (wide.rope_cos, wide.rope_sin))[0],
                (wide.rope_cos, wide.rope_sin),
            )[0]
        )
        expected = torch.nn.functional.linear(hidden, wide.token_embedding.weight) / 4
        assert torch.allclose(wide(ids), expected, atol=1e-5)
