"""Weights packed once for the CPU's matrix products, from a batch-1 decode to a prompt of thousands of tokens.

What: ``PackedLinear`` keeps the plain weight (a ``nn.Linear`` whose parameters, checkpoint mapping, sharding and
quantization code are unchanged) and adds a copy in the blocked layout of ``kernels/linear_cpu.py``, whose op
multiplies it at any row count with no per-shape state (that docstring says why it beats ``F.linear``, which re-lays
the weight out on every call; reports/PERFORMANCE.md has the measurements: faster at every row count on the AMD EPYC).
Under ``torch.compile`` the product is the op's registered operator (``torch.ops.workbench_linear.blocked_linear``,
with a fake kernel), which inductor calls as one opaque kernel.

When: products of ``PACKED_MIN_ROWS`` rows or more (``packed_min_rows``), for a weight of at least
``PACKED_MIN_WEIGHT`` elements (``worth_packing``): a small matrix gains nothing, its plain weight stays in cache and
the re-layout is cheap while a packed call has a fixed cost. So a model of small matrices keeps every linear plain,
and everything that depends on packing (the fitted profile's kernel break, the op profile's packed products, the
compiled ragged step's row ranges) follows the layers actually packed (``count_packed``), not
``EngineConfig.packed_linears`` alone. Packing needs fp32 weights and the op built (``packing_available``): a bf16
model, or a machine without a compiler, runs plain products.

Cost: a second copy of every packed weight in memory; the bytes a product reads are one copy's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from workbench.errors import ConfigError
from workbench.hardware import cpu_vendor

# one (in x out) matrix at a time, plain and packed (oneDNN's layout of then) alternated, best of 5 (AMD EPYC
# Zen 3, AVX2, 1 thread, torch 2.13, fp32, 2026-12-04, load 1.5-1.8): packed / plain speed at 4 / 8 / 16 / 64 / 256
# rows: 64x320 (20,480 elements) 0.24 / 0.30 / 0.38 / 0.60 / 0.82x; 384x384 (147,456) 0.78 / 0.83 / 0.83 / 0.86 /
# 0.93x; 448x448 (200,704) 0.88 / 0.96 / 0.88 / 0.85 / 0.89x; 512x512 and 256x1024 (262,144) 0.98-1.00 / 1.06-1.11 /
# 0.99 / 0.94-0.98 / 0.94-0.97x; 576x576 (331,776) 1.14 / 1.10 / 1.02 / 0.91 / 0.87x; 576x3072 1.45 / 1.38 / 1.11 /
# 0.88 / 0.94x. Whole models (workbench bench linear --threads 1, same load): tiny-gqa 0.31-0.79x at 4-256 rows,
# SmolLM2-135M 1.28-2.13x. Break-even near 262,144 elements: pack from 300,000 on.
PACKED_MIN_WEIGHT = 300_000  # elements (in x out) a weight needs for pack_linears to pack it
PACKED_DTYPES = (torch.float32,)  # what the blocked op multiplies


def packed_min_rows(vendor: str) -> int:
    """The fewest rows a packed product takes on a CPU of ``vendor`` (``workbench.hardware.cpu_vendor``): 4 on
    Intel's, whose MKL matrix-vector products beat oneDNN's packed ones at 1-3 rows on the project's Xeon (0.90x at 1
    row, 0.82x at 2: the packed layout of then; the blocked op has not been measured on an Intel CPU), 1 elsewhere,
    where the plain product is the slower at every row count (the module docstring)."""
    return 4 if vendor == "GenuineIntel" else 1


PACKED_MIN_ROWS = packed_min_rows(cpu_vendor())


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed linears can run here: a CPU, fp32, and the blocked op built (``kernels/linear_cpu.py``)."""
    from workbench.kernels import linear_cpu

    return device.type == "cpu" and dtype in PACKED_DTYPES and linear_cpu.available()


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` that also holds its weight in the blocked layout of ``kernels/linear_cpu.py``."""

    packed_weight: torch.Tensor
    isa: int  # the op's code path (``linear_cpu.ISAS``), chosen when the layer is packed

    @classmethod
    def wrap(cls, linear: nn.Linear) -> PackedLinear:
        """A ``PackedLinear`` sharing ``linear``'s weight and bias (a tied weight stays tied)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        from workbench.kernels import linear_cpu

        # a plain attribute, not a buffer: it is no state (state_dict, .to(), byte counts over buffers skip it)
        new.packed_weight = linear_cpu.pack(linear.weight)
        new.isa = linear_cpu.ISAS[linear_cpu.default_isa()]
        return new

    def plain(self) -> nn.Linear:
        """An ``nn.Linear`` sharing this layer's weight and bias, without the packed copy."""
        plain = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(plain)
        plain.in_features, plain.out_features = self.in_features, self.out_features
        plain.weight, plain.bias = self.weight, self.bias
        return plain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows < PACKED_MIN_ROWS or x.dtype != self.weight.dtype:
            return super().forward(x)
        x2 = x.reshape(rows, x.shape[-1])
        y = torch.ops.workbench_linear.blocked_linear.default(
            x2, self.packed_weight, self.bias, self.out_features, self.isa
        )
        return y.reshape(*x.shape[:-1], self.out_features)


def worth_packing(in_features: int, out_features: int, min_weight: int | None = None) -> bool:
    """Whether ``pack_linears`` packs a weight of ``in_features`` x ``out_features``: at least ``min_weight``
    elements (None: ``PACKED_MIN_WEIGHT``, read at the call, so a test may lower it for every engine it builds)."""
    threshold = PACKED_MIN_WEIGHT if min_weight is None else min_weight
    return in_features * out_features >= threshold


def pack_linears(model: Any, min_weight: int | None = None) -> int:
    """Replace the plain ``nn.Linear`` layers of ``model`` (a ``workbench.model.transformer.Transformer``) whose
    weight has at least ``min_weight`` elements (``worth_packing``; None: ``PACKED_MIN_WEIGHT``) by ``PackedLinear``
    in place, where ``packing_available``; smaller, quantized and already packed layers are left as they are.
    Returns how many layers were packed by this call (0 for a model of small matrices)."""
    if min_weight is not None and (not isinstance(min_weight, int) or min_weight < 0):
        raise ConfigError(f"min_weight must be a non-negative integer or None, got {min_weight!r}")
    if not packing_available(model.device, model.dtype):
        return 0
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and worth_packing(child.in_features, child.out_features, min_weight):
                setattr(module, name, PackedLinear.wrap(child))
                count += 1
    return count


def count_packed(model: Any) -> int:
    """How many layers of ``model`` are ``PackedLinear`` now: what every consumer of packing follows (0: every
    product is plain, whatever ``EngineConfig.packed_linears`` says)."""
    return sum(isinstance(m, PackedLinear) for m in model.modules())


def unpack_linears(model: Any) -> int:
    """Undo ``pack_linears``: each ``PackedLinear`` back to an ``nn.Linear`` with the same weight and bias (the
    engine calls it when ``packed_linears`` is off, since a model may have been packed by an earlier engine)."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, PackedLinear):
                setattr(module, name, child.plain())
                count += 1
    return count


@contextmanager
def plain_linears(model: Any) -> Iterator[None]:
    """Run ``model`` with plain ``nn.Linear`` products inside the block, whatever an engine packed before; on exit
    the very ``PackedLinear`` objects it held are put back (no second re-layout). The measurement hygiene's
    reference step uses it: an engine packs the model it is given (``Engine.__init__``), so without it a reference
    timed before the first engine and one timed after would run different products."""
    swapped = [(m, name, c) for m in model.modules() for name, c in m.named_children() if isinstance(c, PackedLinear)]
    unpack_linears(model)
    try:
        yield
    finally:
        for module, name, child in swapped:
            setattr(module, name, child)
