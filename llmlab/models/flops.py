"""Model FLOPs utilisation: achieved training FLOP/s over the device's dense peak (llm.c-style table).

Peaks are dense tensor-core TFLOP/s with fp32 accumulation (what PyTorch uses for bf16/fp16 matmuls),
and plain fp32 for full-precision runs. Unknown devices and CPUs have no entry: MFU is then not reported,
rather than reported against a guess.
"""
from __future__ import annotations

# name fragment (matched against torch.cuda.get_device_name, longest first) -> {precision: peak TFLOP/s}
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp32": 19.5},
    "RTX 4090": {"bf16": 165.2, "fp32": 82.6},
    "RTX 4060": {"bf16": 30.2, "fp32": 15.1},
    "RTX 3090": {"bf16": 71.0, "fp32": 35.6},
}


def peak_flops(device_name: str | None, mixed_precision: str) -> float | None:
    """Peak FLOP/s of one device for this precision, or None when unknown (CPU, unlisted GPU)."""
    if not device_name:
        return None
    precision = "fp32" if mixed_precision in (None, "no") else "bf16"
    for fragment in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if fragment.lower() in device_name.lower():
            return PEAK_TFLOPS[fragment][precision] * 1e12
    return None


def current_device_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def mfu(tokens_per_sec: float, flops_per_token: float, peak_per_device: float | None, num_devices: int = 1):
    if not peak_per_device or tokens_per_sec <= 0:
        return None
    return tokens_per_sec * flops_per_token / (peak_per_device * num_devices)


def flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12·L·d·T (attention)."""
    config = model.config  # GPT-2's attribute_map gives it the generic names too
    return 6 * model.num_parameters() + 12 * config.num_hidden_layers * config.hidden_size * seq_len
