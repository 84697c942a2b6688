"""Where work runs: the device (CPU or CUDA) a command asked for."""
from __future__ import annotations

from llmlab.core.errors import UserError


def resolve_device(device: str) -> str:
    """auto = CUDA when available, else CPU; asking for CUDA without one is a user error."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible to PyTorch; use --device cpu (or auto)")
    return device
