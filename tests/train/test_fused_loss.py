"""The chunked output layer + cross-entropy (issue 15): the same loss and gradients as the full logits."""

import json

import pytest
import torch

from llmlab.train.loss import CausalLMWithLoss, causal_lm_loss, chunked_lm_loss


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_chunked_loss_and_gradients_equal_the_full_logits(smoothing):
    torch.manual_seed(0)
    hidden = torch.randn(3, 20, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(60, 16, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 60, (3, 20))
    full = causal_lm_loss(hidden @ weight.T, ids, smoothing)
    full.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    chunked = chunked_lm_loss(hidden, weight, ids, smoothing, chunk_tokens=7)  # chunks that cut across rows
    chunked.backward()
    assert chunked.item() == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(hidden.grad, grads[0], atol=1e-7) and torch.allclose(weight.grad, grads[1], atol=1e-7)
    with torch.no_grad():  # evaluation: no gradients computed or kept
        assert float(chunked_lm_loss(hidden, weight, ids, smoothing, 7)) == pytest.approx(float(full), abs=1e-6)


def test_wrapped_gpt2_trains_identically_through_the_chunked_head(tiny_gpt2_dir):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 50257, (2, 32))
    results = []
    for chunk in (0, 24):
        torch.manual_seed(0)
        model = CausalLMWithLoss(AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir), 0.1, chunk).train()
        loss = model(ids)
        loss.backward()
        results.append((float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (full_loss, full_grads), (chunked_loss, chunked_grads) = results
    assert chunked_loss == pytest.approx(full_loss, abs=1e-5)
    for name, grad in full_grads.items():  # the tied embedding gets both its input and its head gradient
        assert torch.allclose(chunked_grads[name], grad, atol=1e-5), name
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 matmuls, fp32 softmax: close to fp32
        torch.manual_seed(0)
        model = CausalLMWithLoss(AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir), 0.1, 24)
        assert float(model(ids)) == pytest.approx(full_loss, abs=2e-2)


def test_measuring_the_cpu_peak_leaves_the_global_rng_alone():
    """The trainers measure the matmul peak after a resume restored the RNG; dropout must not notice."""
    from llmlab.models import flops

    flops._CPU_PEAKS.clear()
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert flops.measure_cpu_peak_flops("fp32", size=64, repeats=1) > 0
    assert torch.equal(torch.rand(3), expected)


def test_the_trainers_measure_the_cpu_peak_once_per_machine_and_threads(tmp_path, monkeypatch):
    """A run's start reads the peak another run on this machine measured; another thread count, another machine
    label or a damaged cache file is measured (again) and the file rewritten whole."""
    from llmlab.models import flops

    monkeypatch.setenv("LLMLAB_CACHE", str(tmp_path))
    measured = []
    monkeypatch.setattr(flops, "measure_cpu_peak_flops", lambda p: measured.append(p) or 1e9 * (len(measured) + 1))
    threads = torch.get_num_threads()
    try:
        assert flops.peak_flops(None, "no") == 2e9 and flops.peak_flops(None, "no") == 2e9
        assert flops.peak_flops(None, "bf16") == 3e9 and measured == ["fp32", "bf16"]
        torch.set_num_threads(threads + 1)
        assert flops.peak_flops(None, "no") == 4e9
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("LLMLAB_MACHINE_LABEL", "another CPU +bf16")
    assert flops.peak_flops(None, "no") == 5e9 and len(json.loads((tmp_path / "cpu-peak.json").read_text())) == 4
    (tmp_path / "cpu-peak.json").write_text('{"truncated')
    assert flops.peak_flops(None, "no") == 6e9 and len(json.loads((tmp_path / "cpu-peak.json").read_text())) == 1


def test_measuring_the_cpu_peak_keeps_to_its_time_budget_in_every_precision():
    """Where bf16 is emulated (no bf16 units) one 2048 x 2048 bf16 matmul takes tens of seconds: the measurement
    held every bf16 run's start for minutes. It now stops growing the matrix when the next size would not fit."""
    import time

    from llmlab.models import flops

    for precision in ("fp32", "bf16"):
        flops._CPU_PEAKS.clear()
        start = time.perf_counter()
        peak = flops.measure_cpu_peak_flops(precision, budget_s=0.5)
        # the last size may take up to its share of the budget, and the one before it was below it
        assert peak > 0 and time.perf_counter() - start < 5, precision
