"""Model FLOPs utilisation: achieved training FLOP/s over the device's dense peak.

GPU peaks come from a table (dense tensor-core TFLOP/s with fp32 accumulation for bf16/fp16, plain fp32 otherwise;
llm.c-style). A CPU has no such datasheet number that holds on a shared machine, so its peak is measured: the
best of a few matmuls of up to 2048 x 2048 in the training precision on the threads the run uses (bench/cpu_peak.py
prints it; 158 GFLOP/s fp32 and 366 bf16 on two threads of this project's EPYC), once per machine, torch version,
thread count and precision: the trainers read it from llmlab's cache (`cpu-peak.json`; delete it to measure again),
so every run on one machine divides by the same number, and a run's start skips 1-2 s of matmuls (bench/startup.py).
Unlisted GPUs get no MFU rather than one against a guess.
"""

from __future__ import annotations

import json
import math
import time

from llmlab.core.io import atomic_write_bytes, llmlab_cache
from llmlab.core.runinfo import machine_label

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
    """Peak FLOP/s of one device for this precision: measured on a CPU (`device_name` None), from the table on a
    GPU, None for an unlisted GPU."""
    precision = "fp32" if mixed_precision in (None, "no") else "bf16"
    if not device_name:
        return cached_cpu_peak_flops(precision)
    for fragment in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if fragment.lower() in device_name.lower():
            return PEAK_TFLOPS[fragment][precision] * 1e12
    return None


_CPU_PEAKS: dict[tuple[str, int, int], float] = {}


def measure_cpu_peak_flops(precision: str = "fp32", size: int = 2048, repeats: int = 5, budget_s: float = 2.0) -> float:
    """Best-of-`repeats` FLOP/s of a square matmul on this CPU's current torch threads (cached per process): up to
    size x size, doubling from 256 while the next size fits `budget_s`. The budget matters where bf16 is emulated
    (no bf16 units): there one 2048 x 2048 bf16 matmul takes tens of seconds, and the full measurement held a run's
    start for minutes; a smaller matrix measures that slow path just as well."""
    import torch

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    key = (precision, torch.get_num_threads(), size)
    if key not in _CPU_PEAKS:
        own = torch.Generator().manual_seed(0)  # never the global RNG: a resumed run's dropout must not move
        side = min(256, size)
        while True:
            a, b = (torch.randn(side, side, generator=own).to(dtype) for _ in range(2))
            torch.mm(a, b)  # warm-up: thread pool, kernel selection
            best = min(_timed(lambda a=a, b=b: torch.mm(a, b), time.perf_counter) for _ in range(repeats))
            if side >= size or 8 * best * (repeats + 1) > budget_s:  # the next size costs 8x as much
                break
            side = min(2 * side, size)
        _CPU_PEAKS[key] = 2 * side**3 / best
    return _CPU_PEAKS[key]


def cached_cpu_peak_flops(precision: str) -> float:
    """measure_cpu_peak_flops, measured once per machine (runinfo.machine_label), torch version and thread count and
    then read from llmlab's cache. A missing or unreadable cache is measured again and rewritten atomically."""
    import torch

    path = llmlab_cache("cpu-peak.json")
    key = f"{machine_label()} | torch {torch.__version__} | {torch.get_num_threads()} threads | {precision}"
    known = _read_peaks(path)
    peak = known.get(key)
    if isinstance(peak, (int, float)) and math.isfinite(peak) and peak > 0:
        return float(peak)
    known[key] = measure_cpu_peak_flops(precision)
    try:
        atomic_write_bytes(path, json.dumps(known, indent=1, sort_keys=True).encode())
    except OSError:  # a read-only or full cache disk costs the next run a measurement, not this run
        pass
    return known[key]


def _read_peaks(path) -> dict:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _timed(fn, clock) -> float:
    start = clock()
    fn()
    return clock() - start


def current_device_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def mfu(tokens_per_sec: float, flops_per_token: float, peak_per_device: float | None, num_devices: int = 1):
    if not peak_per_device or tokens_per_sec <= 0:
        return None
    return tokens_per_sec * flops_per_token / (peak_per_device * num_devices)


def flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12·L·d·T (attention). GPT-2 (its config's
    generic names) or the lab's minimal Transformer (its cfg)."""
    if hasattr(model, "config"):  # GPT-2's attribute_map gives it the generic names too
        layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    else:
        layers, hidden = model.cfg.n_layer, model.cfg.width
    return 6 * sum(p.numel() for p in model.parameters()) + 12 * layers * hidden * seq_len
