"""fp32 matrix products ``x @ W^T (+ bias)`` on the CPU over a weight laid out in blocks of 64 output columns, as a
small C++ op: the engine's product for every row count, from a batch-1 decode to a prompt of thousands of tokens.

Why our own op: torch's CPU products re-lay the weight out on every call (``F.linear``: MKL or oneDNN on the plain
(out, in) weight), or, through ``torch.ops.mkldnn`` on a weight packed once (``_reorder_linear_weight``), build a
oneDNN primitive per (matrix, row count), kept in two caches of ~0.6 MiB a shape, which an engine whose token counts
vary from step to step can only bound by padding its products to a few row counts; torch's wheel exports no oneDNN
symbol, so an extension cannot call oneDNN with a run-time row count either. And at few rows oneDNN's packed product
reads the weights well below the memory's speed. Measured on this project's 2-core AMD EPYC (Zen 4, AVX-512, torch
2.13, 2 threads, bench-300m's four layer matrices, six layers' copies so that they stream from memory, 8 rounds
alternated, medians, 2026-12-06; ``workbench bench linear`` compares plain and packed on the machine at hand): this
op's AVX-512 path against oneDNN's packed product as the engine ran it (padded rows, 256-row slices) 1.30x as fast at
1 row, 1.46x at 2, 1.31x at 4 and 8, 1.17x at 16, 1.08x at 32, 1.04x at 64 to 176, 1.10x at 300, 0.99x at 512, 1.07x
at 1,519; its AVX2 path against oneDNN held to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``) 1.36x at 1 row, 1.05-1.09x at 4 to
16, 0.97x at 96, 1.18x at 300, 0.91x at 1,519 (reports/PERFORMANCE.md has the table).

The layout (``pack``): (N / 64, K, 64), block b holding output columns 64b .. 64b + 63 input after input (N padded
with zero columns to a multiple of 64), so a block is one sequential stream of memory. A task multiplies one block
by up to 192 rows of x, in chunks of 512 inputs (a 128 KB panel, read once from memory, then from L2 for each
micro-tile of rows): on AVX-512 6 rows x 64 columns of accumulators in registers, each load of 64 weights feeding 6
rows' FMAs with x broadcast. So a decode step reads each weight once, in one sequential stream per thread, and a
prompt runs as a register-blocked GEMM (the same loop nest BLIS-style GEMMs use, with the weight already packed).

Built on first use with the machine's g++ (``torch.utils.cpp_extension.load``, cached under
``TORCH_EXTENSIONS_DIR``), registered as ``torch.ops.workbench_linear.blocked_linear`` with a fake kernel so
``torch.compile`` keeps it one opaque call. Like ``kernels/paged_decode_cpu.py`` the body is compiled for AVX-512,
AVX2+FMA and the baseline x86-64 and ``isa`` picks one per call (``isa_paths``, ``WORKBENCH_CPU_ISA``).
``available()`` is False when no compiler is present; ``workbench.model.packed`` then keeps the plain products.
The reference is ``torch.nn.functional.linear`` on the plain weight, which the tests compare with on every code path.
"""

from __future__ import annotations

from pathlib import Path

import torch
from workbench.kernels.paged_decode_cpu import ISAS, CppOp, CpuKernelError

COLS = 64  # output columns per block of the layout
_SOURCE = Path(__file__).with_name("csrc") / "linear_cpu.cpp"


def _register_fakes() -> None:
    @torch.library.register_fake("workbench_linear::blocked_linear")
    def _fake(x, packed, bias, n_out, isa):
        return x.new_empty(x.shape[0], n_out)


_OP = CppOp("workbench_linear_cpu", _SOURCE, ["-O3", "-fno-math-errno"], _register_fakes, "workbench_linear")
available = _OP.available
build_error = _OP.build_error
supported_isas = _OP.supported_isas
default_isa = _OP.default_isa


def pack(weight: torch.Tensor) -> torch.Tensor:
    """An (out, in) fp32 weight -> the op's layout: (ceil(out / 64), in, 64), block b holding output columns 64b ..
    64b + 63 (zeros past ``out``) input after input."""
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise CpuKernelError(f"the blocked linear op packs a 2-D fp32 weight, got {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    w = weight.detach()
    if n % COLS:
        w = torch.cat((w, w.new_zeros(COLS - n % COLS, k)))
    return w.reshape(w.shape[0] // COLS, COLS, k).transpose(1, 2).contiguous()


def blocked_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int, isa: str
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for (rows, in) fp32 ``x`` over ``pack``'s layout of W: (rows, out_features) fp32."""
    _OP.check_isa(isa, "CPU blocked linear op")
    return torch.ops.workbench_linear.blocked_linear(x, packed, bias, out_features, ISAS[isa])
