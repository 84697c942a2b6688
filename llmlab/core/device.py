"""Where work runs: the device (CPU or CUDA), its precision, and how many CPU threads a process gets."""

from __future__ import annotations

import os

from llmlab.core.errors import UserError


def resolve_device(device: str) -> str:
    """auto = CUDA when available, else CPU; asking for CUDA without one is a user error."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible to PyTorch; use --device cpu (or auto)")
    return device


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run ~2x fp32 there (366 vs 158 GFLOP/s measured on this project's CPU)."""
    import torch

    if os.environ.get("LLMLAB_MACHINE_LABEL"):  # a test playing another machine (core.runinfo.machine_label)
        return os.environ["LLMLAB_MACHINE_LABEL"].endswith("+bf16")
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def resolve_precision(precision: str, device: str) -> str:
    """`auto` -> what is fast and safe here: bf16 on CUDA GPUs that have it and on CPUs with bf16 units,
    fp16 (with loss scaling) on older GPUs, fp32 otherwise. An explicit choice is checked, not overridden."""
    import torch

    if precision == "auto":
        if device == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "bf16" if cpu_has_fast_bf16() else "fp32"
    if precision == "fp16" and device != "cuda":
        raise UserError("--precision fp16 needs a CUDA GPU (no fp16 loss scaling on CPU); use bf16 or fp32")
    return precision


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_cpu_threads(requested: int, local_processes: int, log=print) -> int:
    """Threads for a CPU run. `accelerate launch` without --cpu exports OMP_NUM_THREADS=1, which trains a single
    process on one core (442 vs 705 tokens/s measured on 2 cores): undo that, giving each local process its share
    of the cores, and say so. An explicit `requested` count always wins."""
    import torch

    if requested:
        torch.set_num_threads(requested)
        return requested
    share = max(1, available_cores() // max(1, local_processes))
    launcher_forced = os.environ.get("OMP_NUM_THREADS") == "1" and "ACCELERATE_DYNAMO_BACKEND" in os.environ
    if launcher_forced and share > 1:
        torch.set_num_threads(share)
        log(
            f"note: accelerate launch set OMP_NUM_THREADS=1; using {share} threads per process "
            f"({available_cores()} cores, {local_processes} local process(es)); --cpu_threads N overrides"
        )
    return torch.get_num_threads()


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB: Linux's high-water mark (VmHWM), Windows' peak working set, else
    the current RSS (psutil; macOS has no peak there). Portable, unlike `resource` (absent on Windows, and in bytes
    rather than KiB on macOS)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import psutil  # here, not at the top: on Linux the answer above needs no psutil

    info = psutil.Process().memory_info()
    return getattr(info, "peak_wset", info.rss) / 2**20
