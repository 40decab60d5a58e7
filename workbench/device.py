"""Devices and dtypes ('auto' picks CUDA when present, the CPU otherwise), and the operators a compiled graph calls
opaquely (``graph_op``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def inductor_compile(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    """``torch.compile(fn, dynamic=False, **kwargs)`` with dynamo's recompile limit raised to at least 64: each batch
    size, token range, matrix shape and model in a process is a recompilation of the same code object, which past
    dynamo's default of 8 would run eagerly."""
    import torch._dynamo as dynamo  # imported when used: it costs a second at import

    dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 64)
    return torch.compile(fn, dynamic=False, **kwargs)


_LIBRARIES: dict[str, torch.library.Library] = {}  # one fragment per namespace, alive as long as the process


def graph_op(
    qualname: str, schema: str, impl: Callable[..., torch.Tensor], fake: Callable[..., torch.Tensor]
) -> torch._ops.OpOverload:
    """Define the operator ``qualname`` ('namespace::name') with ``schema`` (its arguments and result in torch's
    schema language, e.g. ``"(Tensor x, int n) -> Tensor"``), run by ``impl`` on every backend and by ``fake`` on
    fake tensors, and return it (``torch.ops.namespace.name.default``). ``torch.compile`` keeps a call of it as one
    opaque node, which inductor calls as it is.

    The dispatcher calls ``impl`` directly, without the wrapper layers of ``torch.library.custom_op`` (~10 us a call
    less: reports/PERFORMANCE.md), which matters for an operator called for every layer of a compiled step
    (``workbench::ragged_attend``). Like an operator of ``custom_op(mutates_args=())``, it has no autograd formula.
    """
    namespace, name = qualname.split("::")
    if namespace not in _LIBRARIES:
        _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    _LIBRARIES[namespace].define(name + schema)
    _LIBRARIES[namespace].impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname)(fake)
    return getattr(getattr(torch.ops, namespace), name).default
