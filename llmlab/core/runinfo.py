"""What a run folder records about itself: the resolved config, package versions and hardware."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from llmlab.core.config import dump_yaml
from llmlab.core.device import available_cores, cpu_has_fast_bf16
from llmlab.core.io import atomic_write_json, atomic_write_text

TRACKED_PACKAGES = (
    "torch",
    "transformers",
    "accelerate",
    "deepspeed",
    "datasets",
    "peft",
    "bitsandbytes",
    "statsmodels",
    "tensorboard",
    "lion-pytorch",
    "numpy",
)


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def hardware_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "machine": machine_label(),
        "cpu_count": os.cpu_count(),
        "cores_available": available_cores(),
        "torch_threads": torch.get_num_threads(),
        "cpu_bf16": cpu_has_fast_bf16(),
        "cuda_available": torch.cuda.is_available(),
        "torch_cuda": torch.version.cuda,
    }
    try:
        info["memory_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        info["memory_gb"] = None
    if torch.cuda.is_available():
        info["gpus"] = [
            {
                "name": torch.cuda.get_device_name(i),
                "memory_gb": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
            }
            for i in range(torch.cuda.device_count())
        ]
    return info


def machine_label() -> str:
    """The CPU as a statistic must tell machines apart: model name, family/model/stepping (AMD and Intel both ship
    several CPUs named just "AMD EPYC" / "Intel Xeon Processor") and whether it has bf16 units (the lab's trials
    then run bf16). No torch import: a trial and the sweep driver both call it. LLMLAB_MACHINE_LABEL replaces it
    (tests play another machine with it; a label ending in -bf16 is then a CPU without bf16 units)."""
    if os.environ.get("LLMLAB_MACHINE_LABEL"):
        return os.environ["LLMLAB_MACHINE_LABEL"]
    fields: dict[str, str] = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "stepping", "flags") and key not in fields:
                fields[key] = value.strip()
            if key == "flags":
                break
    except OSError:
        return platform.processor() or platform.machine() or "unknown"
    flags = set(fields.get("flags", "").split())
    bf16 = "+bf16" if flags & {"avx512_bf16", "amx_bf16"} else "-bf16"
    return (
        f"{fields.get('model name', platform.machine())} (family {fields.get('cpu family', '?')} model "
        f"{fields.get('model', '?')} stepping {fields.get('stepping', '?')}) {bf16}"
    )


def _cpu_model() -> str | None:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def write_run_info(output_dir: str | os.PathLike, cfg: Any) -> None:
    """Write config.yaml (re-runnable with --config) and run_info.json (versions, hardware, command)."""
    out = Path(output_dir)
    atomic_write_text(out / "config.yaml", dump_yaml(cfg))
    atomic_write_json(
        out / "run_info.json", {"command": sys.argv, "versions": package_versions(), "hardware": hardware_info()}
    )
