"""Devices and dtypes: 'auto' picks CUDA when present, the CPU otherwise."""

from __future__ import annotations

import torch

from workbench.config import canonical_dtype
from workbench.errors import ConfigError

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """'auto' -> cuda if available else cpu; 'cpu', 'cuda', 'cuda:N' as given (CUDA checked for availability)."""
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} requested but CUDA is not available; use 'cpu' or 'auto'")
        return torch.device(name)
    if name == "cpu":
        return torch.device("cpu")
    raise ConfigError(f"unknown device {name!r}; expected 'auto', 'cpu', 'cuda' or 'cuda:N'")


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """'fp32' / 'float16' / 'bf16' ... -> torch dtype (fp32, fp16, bf16 are supported for compute)."""
    if isinstance(name, torch.dtype):
        return name
    key = canonical_dtype(name)
    if key not in TORCH_DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported for compute; expected one of fp32, fp16, bf16")
    return TORCH_DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """The workbench's short name ('fp32', 'fp16', 'bf16') of a torch compute dtype."""
    for name, value in TORCH_DTYPES.items():
        if value == dtype:
            return name
    raise ConfigError(f"dtype {dtype} is not a compute dtype of the workbench; expected one of fp32, fp16, bf16")


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (a no-op on the CPU), so that wall-clock timings are honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
