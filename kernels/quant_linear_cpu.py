"""Weight-only int8 / int4 matrix products on the CPU for decode (a few rows of activations), as a small C++ op.

Why our own op (measured on this project's 2-core AMD EPYC, AVX2, torch 2.13, bench-300m's matrices): torch's
packed CPU operators are vectorized only for bf16 activations, which AVX2 emulates (``_weight_int8pack_mm`` fed
fp32 takes a scalar loop, 5x the fp32 GEMV; fed bf16 it reached int8/fp32 1.62x of a whole decode step against
the 4x the bytes allow, and ``_weight_int4pack_mm_for_cpu`` int4/int8 1.13x against 2x); inductor's loops over
``int8_rows``/``int4_rows`` keep one accumulator per output row, so they run at the latency of their adds;
torchao ends in the same aten operators; ONNX Runtime's ``MatMulNBits`` is not installed here and would add a
session per matrix. The fix is the one llama.cpp's R4/R8 layouts made: rows interleaved so that one activation load
feeds several accumulators.

The op (``kernels/csrc/quant_linear_cpu.cpp``) reads weights packed 8 output rows interleaved (``pack_int8``,
``pack_int4``: 64 bytes hold 8 inputs of 8 rows in int8, 128 bytes 32 inputs of 8 rows in int4). int8: fp32 activations,
fp32 accumulation; at one row of x each activation vector load feeds 8 rows' FMAs in 8 accumulators, the codes widened
and converted in registers (on AVX-512 16 codes per convert, two rows' chunk, and two ranges of the inputs walked side
by side with a far prefetch: one stream per thread read 8.8 GB/s a core on the 2-core Intel Xeon, where the fp32 GEMV
reads 14; the measurements are beside ``INT8_PREFETCH`` in the source). int4 has a scale and an offset per group of
inputs and row (``w = code * scale + offset``), folded in as ``scale * sum(code * x) + offset * sum(x)``; at one row of
x the activations are quantized to int8 per group (as llama.cpp's Q8 activations) and ``sum(code * xq)`` runs in
integers, because with fp32 activations the int4 loop is bound by its per-weight converts, not by memory (measured: 7.5
GB/s of int4 against int8's 20 GB/s per thread, int4 slower than int8): one 32-byte load holds two rows' 32 codes,
``vpmaddubsw`` (unsigned codes times int8 inputs) sums pairs in int16 for up to 4 chunks, then ``vpmaddwd`` widens to
int32 and the 8 rows' lanes are brought together once per group; the weights are prefetched 2 KB ahead, without which
the hardware prefetcher fell behind the loop (on the 2-core AMD EPYC, bench-300m's matrices swept at one row, 2
threads, interleaved: the sweep went from 1.3x to 1.7x faster than int8's). At more rows a block of 256 inputs is
dequantized once into an L1 buffer (fp32) and every row of x is multiplied against it. int8 applies its per-row scale
once at the end. ``workbench.model.quant.int4_op_reference`` states the int4 op in plain PyTorch.

Built on first use with the machine's g++ (``torch.utils.cpp_extension.load``, cached under
``TORCH_EXTENSIONS_DIR``), registered as ``torch.ops.workbench_quant.int8_linear`` / ``int4_linear`` with fake
kernels so ``torch.compile`` keeps each as one opaque call. Like ``kernels/paged_decode_cpu.py`` the body is compiled
for AVX-512, AVX2+FMA and the baseline x86-64 and ``isa`` picks one per call (``isa_paths``, ``WORKBENCH_CPU_ISA``).
``available()`` is False when no compiler is present; ``workbench.model.quant`` then keeps torch's operators. The
plain-PyTorch references are ``workbench.model.quant``'s (``dequantize_int8``, ``dequantize_int4``,
``int4_op_reference``), which the tests compare with on every code path.
"""

from __future__ import annotations

from pathlib import Path

import torch
from workbench.kernels.paged_decode_cpu import ISAS, CppOp, CpuKernelError

ROWS = 8  # output rows interleaved per tile
_SOURCE = Path(__file__).with_name("csrc") / "quant_linear_cpu.cpp"


def _register_fakes() -> None:
    @torch.library.register_fake("workbench_quant::int8_linear")
    def _fake8(x, packed, scale, n_out, isa):
        return x.new_empty(x.shape[0], n_out)

    @torch.library.register_fake("workbench_quant::int4_linear")
    def _fake4(x, packed, scale, offset, n_out, group, isa):
        return x.new_empty(x.shape[0], n_out)


_OP = CppOp("workbench_quant_linear_cpu", _SOURCE, ["-O3", "-fno-math-errno"], _register_fakes, "workbench_quant")
available = _OP.available
build_error = _OP.build_error
supported_isas = _OP.supported_isas
default_isa = _OP.default_isa


# ---- packing (plain tensor operations, at load time) ---------------------------------------------------------------
def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with zero rows appended up to a multiple of ``ROWS`` (the padded rows' outputs are never written)."""
    pad = -t.shape[0] % ROWS
    return t if pad == 0 else torch.cat((t, t.new_zeros(pad, *t.shape[1:])))


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) int8 codes and (out,) scales -> the op's layout: (tiles, in * 8) int8, tile t's chunk c holding
    inputs 8c .. 8c + 7 of rows 8t .. 8t + 7, row after row; scales fp32 padded to (tiles * 8,)."""
    n, k = q.shape
    if k % 8:
        raise CpuKernelError(f"the int8 op needs an input size divisible by 8, got {k}")
    p = _pad_rows(q.to(torch.int8)).view(-1, ROWS, k // 8, 8).permute(0, 2, 1, 3)
    return p.reshape(-1, k * ROWS).contiguous(), _pad_rows(scale.float()).contiguous()


def pack_int4(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, in) codes in [0, 15] and (out, groups) scales and offsets (``w = code * scale + offset``) -> the op's
    layout: (tiles, in * 4) uint8, tile t's chunk c holding inputs 32c .. 32c + 31 of rows 8t .. 8t + 7, 16 bytes
    a row, byte j = input 32c + j (low nibble) | input 32c + 16 + j (high nibble); scales and offsets fp32
    (tiles, groups, 8)."""
    n, k = codes.shape
    groups = scale.shape[1]
    if k % groups or (k // groups) % 32:
        raise CpuKernelError(f"the int4 op needs groups of a multiple of 32 inputs, got {groups} groups of {k}")
    c = _pad_rows(codes.to(torch.uint8)).view(-1, ROWS, k // 32, 2, 16)
    packed = (c[:, :, :, 0] | c[:, :, :, 1] << 4).permute(0, 2, 1, 3).reshape(-1, k * ROWS // 2).contiguous()

    def per_tile(t: torch.Tensor) -> torch.Tensor:
        return _pad_rows(t.float()).view(-1, ROWS, groups).transpose(1, 2).contiguous()

    return packed, per_tile(scale), per_tile(offset)


# ---- the products ----------------------------------------------------------------------------------------------------
def int8_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_features: int, isa: str
) -> torch.Tensor:
    """``x @ (q * scale)^T`` for (rows, in) fp32 ``x`` over ``pack_int8``'s layout: (rows, out_features) fp32."""
    _OP.check_isa(isa, "CPU quantized linear op")
    return torch.ops.workbench_quant.int8_linear(x, packed, scale, out_features, ISAS[isa])


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    out_features: int,
    group_size: int,
    isa: str,
) -> torch.Tensor:
    """``x @ W^T`` for (rows, in) fp32 ``x``, W int4 in ``pack_int4``'s layout: (rows, out_features) fp32."""
    _OP.check_isa(isa, "CPU quantized linear op")
    return torch.ops.workbench_quant.int4_linear(x, packed, scale, offset, out_features, group_size, ISAS[isa])
