"""oneDNN-packed weights for the CPU's middle-sized matrix products: decode batches and short prefill chunks.

``torch.nn.functional.linear`` on the CPU runs MKL's / oneDNN's GEMM on the plain (out, in) weight and re-lays the
weight out for its micro-kernel on every call. For a product of one row (batch-1 decode) that costs nothing next
to reading the weight, and for hundreds of rows it is amortised; in between (a decode batch of 4 to 64 sequences,
a 100-token chunk) it is a large share of the call. torch's own ``torch.ops.mkldnn`` operators let the weight be
re-laid out once, at load (``_reorder_linear_weight``), and multiplied in that blocked layout
(``_linear_pointwise``), which is also what vLLM's CPU backend does through oneDNN. Measured on the 2-core Intel
Xeon of this project (AVX-512, torch 2.13, fp32, the model's matrices, same run): 1.85x faster than ``F.linear``
at 8 rows, 1.26x at 32, 1.13x at 128, even at 256 and more, slower at 1 and 2 rows (0.90x, 0.82x);
``workbench bench linear`` measures the crossover on the machine at hand.

A small matrix loses by it at every row count: its plain weight stays in cache and the re-layout is cheap, while
the packed call's fixed cost is not (AMD EPYC Zen 3, AVX2, 1 thread: tiny-gqa's matrices, at most 64 x 320, run
at 0.21-0.79x of ``F.linear`` from 1 to 256 rows, SmolLM2-135M's, at least 576 x 576, at 1.1-2.3x). So
``pack_linears`` packs only a weight of at least ``PACKED_MIN_WEIGHT`` elements (``worth_packing``): a model of
small matrices keeps every linear plain, and everything that depends on packing (the fitted profile's kernel
breaks, the op profile's packed products, the warm-up of packed shapes, the compiled ragged step's row ranges)
follows the layers actually packed (``count_packed``), not ``EngineConfig.packed_linears`` alone.

``PackedLinear`` keeps the plain weight (a ``nn.Linear`` whose parameters, checkpoint mapping, sharding and
quantization code are unchanged) and adds the packed copy, used for products of ``PACKED_MIN_ROWS`` rows or more
(4 on an Intel CPU, 1 on others: ``packed_min_rows``); a product of more than ``PACKED_MAX_ROWS`` rows runs its
largest multiple of ``PACKED_MAX_ROWS`` rows in one call and the rest in a second (``packed_slices``). The price is
a second copy of every packed weight in memory; the bytes a product reads are one copy's.

oneDNN builds a primitive for every (matrix, rows) shape it is given and keeps it twice over: in its own primitive
cache and in ideep's (1,024 entries each, by default), about 0.6 MiB a shape on torch 2.13 whatever the matrix
(measured: 253 row counts of one 64 x 320 matrix, +154 MiB RSS; both caches at 0 or 1 entries, +2.5 MiB). An engine's
token counts vary from step to step, so at every row count from 4 to 256 a model's handful of matrices would end up
holding ~0.6 MiB x 253 x (distinct matrices): a server's RSS rose for as long as new counts came (``workbench bench soak
--server``: +20% over 10,000 requests on tiny-gqa) and, past 1,024 shapes, evicted primitives were rebuilt (~0.5-3 ms
each). So a product runs at ``packed_rows(rows)`` rows, the input padded with zero rows: its own count up to
``PACKED_EXACT_ROWS``, above that the next multiple of an eighth of its power-of-two octave (at most 1/8 more rows
computed), and 1-3 rows at 4 (``PACKED_PAD_ROWS``): 45 row counts from 4 to 256 in all, made once each; above 256 rows
the multiples of 256 up to the largest step (16 more for a 4,096-token budget). Slicing a large product into 256-row
calls instead would add no shape, but concatenating the slices' outputs copies them all once: 196 against 209 GFLOP/s
for one call at 4,096 rows (bench-300m's layer matrices, AMD EPYC, 2 threads, 2026-12-05), while the plain product ran
at 180.

Under ``torch.compile`` (the engine's compiled decode step) the packed product is the custom operator
``workbench::packed_linear``, which inductor calls as an opaque kernel: inductor's own lowering of
``mkldnn._linear_pointwise`` takes only weights frozen into the graph as constants (``freezing``), which would put
another copy of every weight in each compiled batch size. Without it a compiled step multiplies with plain
``aten.mm``; ``workbench bench compiled`` compares the two.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from workbench.device import graph_op
from workbench.errors import ConfigError
from workbench.hardware import cpu_vendor

# workbench bench linear on the project's 2-core Intel Xeon (bench-300m's matrices, fp32, 2026-12-01, load
# 1.3-3.3): packed / plain speed 0.90x at 1 row, 0.82x at 2, 1.37x at 4, 1.85x at 8, 1.26x at 32, 1.13x at 128,
# 1.03x at 256 and 512, 1.03x at 1024. On a 2-core AMD EPYC (Zen 4, AVX-512, 2026-12-05, load 0.1-1.0) torch's
# plain product (MKL) is slower at every row count, most at a few rows: 1.45x at 1 row, 2.85x at 2, 4.71x at 4,
# 3.14x at 16, 1.62x at 128, 1.48x at 256, 1.25x at 512, 1.13x at 4096. So an Intel CPU multiplies 1-3 rows
# plain, any other from 1 row on (``packed_min_rows``).
PACKED_MAX_ROWS = 256
# one (in x out) matrix at a time, plain and packed alternated, best of 5 (AMD EPYC Zen 3, AVX2, 1 thread, torch
# 2.13, fp32, 2026-12-04, load 1.5-1.8): packed / plain speed at 4 / 8 / 16 / 64 / 256 rows: 64x320 (20,480
# elements) 0.24 / 0.30 / 0.38 / 0.60 / 0.82x; 384x384 (147,456) 0.78 / 0.83 / 0.83 / 0.86 / 0.93x; 448x448
# (200,704) 0.88 / 0.96 / 0.88 / 0.85 / 0.89x; 512x512 and 256x1024 (262,144) 0.98-1.00 / 1.06-1.11 / 0.99 /
# 0.94-0.98 / 0.94-0.97x; 576x576 (331,776) 1.14 / 1.10 / 1.02 / 0.91 / 0.87x; 576x3072 1.45 / 1.38 / 1.11 / 0.88 /
# 0.94x. Whole models (workbench bench linear --threads 1, same load): tiny-gqa 0.31-0.79x at 4-256 rows,
# SmolLM2-135M 1.28-2.13x. Break-even near 262,144 elements: pack from 300,000 on.
PACKED_MIN_WEIGHT = 300_000  # elements (in x out) a weight needs for pack_linears to pack it
PACKED_DTYPES = (torch.float32, torch.bfloat16)
PACKED_EXACT_ROWS = 16  # up to this many rows a product runs at its own row count; above it, at a padded one
# fewer rows run padded to this many: oneDNN's packed product of 1 row (its matrix-vector path) is slower than of 4 at
# the same bytes read (AMD EPYC, every matrix of bench-300m, 2026-12-05: 48.8 against 43.8 ms with 2 threads, 78.0
# against 61.3 with 1; SmolLM2-135M 24.9 / 22.5 and 36.5 / 31.1 ms)
PACKED_PAD_ROWS = 4


def packed_min_rows(vendor: str) -> int:
    """The fewest rows a packed product takes on a CPU of ``vendor`` (``workbench.hardware.cpu_vendor``): 4 on
    Intel's, whose MKL matrix-vector products beat oneDNN's packed ones at 1-3 rows, 1 elsewhere (the measurements
    above)."""
    return 4 if vendor == "GenuineIntel" else 1


PACKED_MIN_ROWS = packed_min_rows(cpu_vendor())


def packed_rows(rows: int) -> int:
    """The row count a packed product of ``rows`` rows runs at (the module docstring): 4 for 1-3 rows
    (``PACKED_PAD_ROWS``), ``rows`` up to ``PACKED_EXACT_ROWS``, above it ``rows`` rounded up to a multiple of 1/8 of
    the power of two at or above it (18, 20, ..., 32, then 36, 40, ..., 64, then 72, ...), so that few distinct
    shapes reach oneDNN."""
    if rows <= PACKED_EXACT_ROWS:
        return max(rows, PACKED_PAD_ROWS)
    step = 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def packed_slices(rows: int) -> list[int]:
    """The row counts of the oneDNN calls a packed product of ``rows`` rows makes: ``packed_rows(rows)`` up to
    ``PACKED_MAX_ROWS``; above it the largest multiple of ``PACKED_MAX_ROWS`` in one call and the rest, if any, at
    ``packed_rows`` of its count."""
    whole = rows - rows % PACKED_MAX_ROWS if rows > PACKED_MAX_ROWS else 0
    return ([whole] if whole else []) + ([packed_rows(rows - whole)] if rows > whole else [])


def _packed_product(x2: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x2`` (rows, in) times the packed weight (+ bias), in the calls of ``packed_slices(rows)`` (zero rows added
    to the last, their results dropped)."""
    rows, done, parts = x2.shape[0], 0, []
    for n in packed_slices(rows):
        take = min(n, rows - done)
        xs = x2 if take == rows else x2[done : done + take]
        if n > take:  # the last call's zero rows
            xs = torch.nn.functional.pad(xs, (0, 0, 0, n - take))
        y = torch.ops.mkldnn._linear_pointwise(xs, packed_weight, bias, "none", [], "")
        parts.append(y[:take] if n > take else y)
        done += take
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# ``x`` (rows, in) times a weight packed by ``_reorder_linear_weight`` (+ bias): (rows, ``out_features``)
packed_linear = graph_op(
    "workbench::packed_linear",
    "(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor",
    lambda x, packed_weight, bias, out_features: _packed_product(x, packed_weight, bias),
    lambda x, packed_weight, bias, out_features: x.new_empty(x.shape[0], out_features),
)


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed linears can run here: a CPU, fp32 or bf16, and a torch built with oneDNN."""
    return device.type == "cpu" and dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` that also holds its weight in oneDNN's blocked layout for middle-sized products."""

    packed_weight: torch.Tensor

    @classmethod
    def wrap(cls, linear: nn.Linear) -> PackedLinear:
        """A ``PackedLinear`` sharing ``linear``'s weight and bias (a tied weight stays tied)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 32)
        # a plain attribute, not a buffer: it is no state (state_dict, .to(), byte counts over buffers skip it)
        new.packed_weight = packed
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
        x2 = x.reshape(rows, x.shape[-1]).contiguous()
        if torch.compiler.is_compiling():  # an opaque call in the graph (see the module's docstring)
            y = packed_linear(x2, self.packed_weight, self.bias, self.out_features)
        else:
            y = _packed_product(x2, self.packed_weight, self.bias)
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
