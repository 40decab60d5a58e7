"""Weight-only quantization of the linear layers: int8 per output channel, int4 group-wise, applied at load time.

Formats (the bytes ``workbench.config.quantized_matrix_bytes`` counts):

- **int8**, symmetric per output channel: ``scale[n] = max_k |w[n, k]| / 127``, ``q = round(w / scale)`` in
  [-127, 127]; ``w ~= q * scale``.
- **int4**, asymmetric group-wise along the input (``group_size`` inputs share a pair): with the group's min and
  max, ``scale = (max - min) / 15``, ``q = round((w - min) / scale)`` in [0, 15], ``zero = min + 8 * scale``, and
  ``w ~= (q - 8) * scale + zero`` (the tinygemm convention).

Which operator runs a product (per device and row count) is in ``Int8Linear`` and ``Int4Linear``; why the CPU's
decode products are our own C++ op is in ``kernels/quant_linear_cpu.py``. ``int8_rows`` and ``int4_rows`` stay as the
no-compiler fallback and the references the torch operators are tested against; ``int4_op_reference`` states the
op's int4 product.

What is quantized: the linear layers of every decoder layer (the fused qkv, o, fused gate/up, down) and the LM head.
A tied LM head shares the embedding table, which stays in the activation dtype (it is a lookup table read one row
per token, and quantizing it would change the embeddings as well as the logits): the head becomes a quantized *copy*
of the table for the logits product alone. That holds the table and the copy (``ModelConfig.weight_bytes`` counts
both: 33 MB more for ``bench-300m`` under int8) and a decode reads the copy instead of the table (the roofline's
``lm_head_bytes``; ``bench-300m``'s int8 step reads 305 instead of 403 MB). Norms and biases stay in the activation
dtype (``ModelConfig.weight_bytes`` counts the same split).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from workbench.config import DEFAULT_GROUP_SIZE, canonical_quantization
from workbench.device import inductor_compile
from workbench.errors import ConfigError

AmaxReduce = Callable[[torch.Tensor], torch.Tensor]  # a row-parallel shard's per-row maximum -> the whole row's

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the packed int4 operators accept
# Up to this many rows a CPU product is the fused dequantize-reduce loop (``int8_rows``, ``int4_rows``): it reads each
# weight byte once per row, so it is a decode kernel; above it the weight is dequantized (int4) or cast (int8) and the
# activation dtype's GEMM runs, which reuses each weight over the rows (``_weight_int8pack_mm`` took 13.6x the fp32
# GEMM's time at 32 rows of a 5632 x 1024 matrix on this 2-core AVX-512 CPU, torch 2.13).
INT8_PACKED_MAX_ROWS = 4
INT8_SPLIT = 4  # products added per accumulation in int8_rows
# Where torch's packed CPU operators (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``, ATen's
# ``native/cpu/int8mm_kernel.cpp`` and ``int4mm_kernel.cpp``) are vectorized for bf16 activations (other dtypes: a
# scalar loop). Fed bf16, one row of bench-300m's matrices ran 6.7-11.7x faster than ``int8_rows`` compiled (2-core
# AMD EPYC, torch 2.13), at the price of bf16's rounding of x and y (3e-3 relative against the int8 format's 8e-3).
INT8_BF16_CAPABILITIES = ("AVX2", "AVX512", "AVX512_BF16", "AVX512_VNNI", "AMX")
# The packed int4 CPU layout depends on the ISA torch dispatches to (32 output rows interleaved per block on AVX2, 64
# on AVX-512), so a layer packs its codes at load time on the CPU that runs it; it takes row counts that divide by 16.
INT4_PACKED_ROWS_MULTIPLE = 16
# Up to this many rows (decode batches) the CPU product is the C++ op of ``kernels/quant_linear_cpu.py``; more rows take
# the GEMM paths below
KERNEL_MAX_ROWS = 32
ENGINE_QUANTIZATIONS = ("int8", "int4")  # fp8 weights: roofline and simulator only (no CPU fp8 matmul here)
CUDA_INT4_INNER_K_TILES = 8


# ---- quantize / dequantize (the references the packed operators are checked against) --------------------------
def quantize_int8(w: torch.Tensor, amax_reduce: AmaxReduce | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (q int8 (out, in), scale fp32 (out,)), symmetric per output channel.
    ``amax_reduce``: a row-parallel shard's columns are part of each row; it maps the shard's per-row maximum to the
    whole row's (the maximum over the ranks), so every rank quantizes with the unsharded model's scales."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    if amax_reduce is not None:
        amax = amax_reduce(amax)
    scale = amax.clamp(min=1e-12) / 127.0  # an all-zero row gets a tiny scale and q = 0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 weight an int8 matrix stands for: ``q * scale[:, None]``."""
    return q.float() * scale.float()[:, None]


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (q int32 in [0, 15] (out, in), scale (out, in/g), zero (out, in/g)) in fp32."""
    out_f, in_f = w.shape
    if in_f % group_size:
        raise ConfigError(f"int4 group size {group_size} does not divide the input size {in_f}")
    wg = w.float().reshape(out_f, in_f // group_size, group_size)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = (hi - lo).clamp(min=1e-12) / 15.0
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32).reshape(out_f, in_f)
    return q, scale, lo + 8.0 * scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The fp32 weight an int4 matrix stands for: ``(q - 8) * scale + zero`` per group."""
    out_f, in_f = q.shape
    groups = scale.shape[1]
    qg = q.float().reshape(out_f, groups, in_f // groups)
    return ((qg - 8.0) * scale[..., None] + zero[..., None]).reshape(out_f, in_f)


# ---- the CPU products of few rows: dequantize and reduce in one loop, compiled by inductor ----------------------
def int8_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (q * scale)^T`` for (rows, in) ``x`` as one fused dequantize-multiply-reduce: ``y[r, n] = scale[n] *
    sum_k x[r, k] * q[n, k]``. Compiled, this is one loop over the int8 rows (no float copy of the weight);
    eagerly it would materialize (rows, out, in), so eager callers use ``_compiled``.

    The inputs are cut into ``INT8_SPLIT`` quarters whose products are added before they meet the accumulator:
    inductor keeps one vector accumulator per output row, so the loop runs at the latency of its adds, and four
    products per add ran the 1 x 1024 by 5632 x 1024 product 1.39x faster than one (in cache, one thread)."""
    rows, k = x.shape
    split = INT8_SPLIT if k % (16 * INT8_SPLIT) == 0 else 1
    xs = x.view(rows, 1, split, k // split)
    qs = q.to(x.dtype).view(q.shape[0], split, k // split)  # a view of the graph's cast, not of the buffer
    acc = xs[:, :, 0] * qs[:, 0]
    for i in range(1, split):
        acc = acc + xs[:, :, i] * qs[:, i]
    return acc.sum(-1) * scale


def int4_rows(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` for (rows, in) ``x`` and int4 codes in the group-halves layout of ``Int4Linear``: ``codes`` (out,
    groups, g/2) uint8, byte j of a group holding code j (low nibble) and code j + g/2 (high nibble); the weight is
    ``code * scale + offset`` per group (``scale``, ``offset``: (out, groups, 1), ``offset = zero - 8 * scale``).
    Both nibbles of a byte meet contiguous halves of the group's inputs, so the compiled loop reads the codes and
    ``x`` without gathers; two groups' products are added per accumulation when the number of groups is even (as
    in ``int8_rows``, 1.11x faster than one)."""
    rows = x.shape[0]
    out_f, groups, half = codes.shape
    pair = 2 if groups % 2 == 0 else 1
    xg = x.view(rows, 1, groups // pair, pair, 2, half)
    # no view of the buffers themselves: inductor's tracing of a view of an inference-mode buffer fails
    lo = ((codes & 15).to(x.dtype) * scale + offset).view(out_f, groups // pair, pair, half)
    hi = ((codes >> 4).to(x.dtype) * scale + offset).view(out_f, groups // pair, pair, half)
    acc = xg[:, :, :, 0, 0] * lo[:, :, 0] + xg[:, :, :, 0, 1] * hi[:, :, 0]
    for i in range(1, pair):
        acc = acc + xg[:, :, :, i, 0] * lo[:, :, i] + xg[:, :, :, i, 1] * hi[:, :, i]
    return acc.sum((-2, -1))


def int4_op_reference(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int
) -> torch.Tensor:
    """What the int4 op of ``kernels/quant_linear_cpu.py`` computes, in plain PyTorch (fp32), over (out, in) codes and
    (out, groups) scales and offsets: for one row of x, x quantized to int8 per group (``quantize_int8`` of
    ``x.view(groups, group_size)``), each group's ``sum(code * xq)`` (exact in int32), then
    ``scale * xscale * sum(code * xq) + offset * sum(x)`` summed over the groups; for more rows the product
    of the dequantized weight ``code * scale + offset``."""
    n, k = codes.shape
    groups = k // group_size
    if x.shape[0] > 1:
        w = (codes.float().view(n, groups, group_size) * scale[..., None] + offset[..., None]).view(n, k)
        return x @ w.T
    xq, xscale = quantize_int8(x.view(groups, group_size))
    dots = torch.einsum("gk,ngk->ng", xq.double(), codes.view(n, groups, group_size).double()).float()
    xsum = x.view(groups, group_size).sum(-1)
    return ((scale * xscale * dots) + offset * xsum).sum(-1)[None]


def cpu_packed_bf16() -> bool:
    """Whether torch's packed int8/int4 CPU operators have a vectorized kernel for bf16 activations on this CPU (the
    ISA torch dispatches to, ``torch.backends.cpu.get_cpu_capability()``, which ``ATEN_CPU_CAPABILITY`` can lower)."""
    return torch.backends.cpu.get_cpu_capability() in INT8_BF16_CAPABILITIES


def cpu_kernel_isa() -> str | None:
    """The code path of the CPU quantized linear op (``kernels/quant_linear_cpu.py``) a layer built now runs, or None
    when the op did not build here (no compiler) or ``WORKBENCH_QUANT_KERNEL=0`` turns it off: the layer then keeps
    torch's packed operators (bf16 activations) or the compiled loops."""
    import os

    if os.environ.get("WORKBENCH_QUANT_KERNEL", "1") == "0":
        return None
    from workbench.kernels import quant_linear_cpu

    return quant_linear_cpu.default_isa() if quant_linear_cpu.available() else None


# each (rows, matrix shape, dtype) recompiles: 4 row counts x a model's 5 matrix shapes
_compile_once = functools.cache(inductor_compile)


def _compiled(fn: Any) -> Any:
    """``fn`` compiled by inductor for eager callers, once per process; inside a compiled graph (the engine's
    compiled decode step) ``fn`` itself, which inductor fuses into the step. One compilation per shape
    (``dynamic=False``: the matrix sizes are constants of the loop), at its first call."""
    return fn if torch.compiler.is_compiling() else _compile_once(fn)


# ---- the quantized linear layers ---------------------------------------------------------------------------------
class Int8Linear(nn.Module):
    """y = x @ (q * scale)^T (+ bias): 1 byte per weight read.

    On CUDA ``aten._weight_int8pack_mm``. On the CPU, products of at most ``KERNEL_MAX_ROWS`` rows (decode) run the
    C++ op of ``kernels/quant_linear_cpu.py`` on fp32 activations over a copy of the codes interleaved 8 rows a tile
    (``kernel_isa``: its code path; ``qweight_tiles``, ``scale_tiles``: attributes, not buffers, the counted format
    is ``qweight``; the copy doubles the codes in memory but not in a decode's reads). Where the op did not build,
    products of at most ``INT8_PACKED_MAX_ROWS`` rows run torch's ``_weight_int8pack_mm`` on bf16 activations
    where torch vectorizes it (AVX2 and up: ``bf16_rows``; fed fp32 it took 5x the fp32 GEMV's time), else
    ``int8_rows`` compiled by inductor. More rows run the activation dtype's GEMM on ``q`` and scale the result.
    """

    def __init__(self, linear: nn.Linear, amax_reduce: AmaxReduce | None = None) -> None:
        super().__init__()
        q, scale = quantize_int8(linear.weight.detach(), amax_reduce)
        dev, dtype = linear.weight.device, linear.weight.dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", q.to(dev))  # (out, in) int8
        self.register_buffer("scale", scale.to(device=dev, dtype=dtype))  # (out,) activation dtype
        # the CPU decode product: our op over the interleaved copy, where it built and the input size divides by 8
        self.kernel_isa = cpu_kernel_isa() if dev.type == "cpu" and self.in_features % 8 == 0 else None
        self.qweight_tiles = self.scale_tiles = None
        if self.kernel_isa is not None:
            from workbench.kernels.quant_linear_cpu import ISAS, pack_int8

            self.kernel_isa_code = ISAS[self.kernel_isa]  # what a compiled graph passes as a constant
            self.qweight_tiles, self.scale_tiles = pack_int8(q, scale)
        # else it feeds torch's int8 kernel bf16 (see INT8_BF16_CAPABILITIES), with a bf16 copy of the scale (2
        # bytes an output row, not a buffer: not part of the format's counted bytes, never moved off the CPU)
        self.bf16_rows = dev.type == "cpu" and self.kernel_isa is None and cpu_packed_bf16()
        self.scale_bf16 = scale.to(torch.bfloat16) if self.bf16_rows else None
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x.device.type != "cpu":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale)
        elif x2.shape[0] <= KERNEL_MAX_ROWS and self.kernel_isa is not None:
            y = torch.ops.workbench_quant.int8_linear(x2.float(), self.qweight_tiles, self.scale_tiles,
                                                      self.out_features, self.kernel_isa_code).to(x.dtype)  # fmt: skip
        elif x2.shape[0] <= INT8_PACKED_MAX_ROWS and self.bf16_rows:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), self.qweight, self.scale_bf16).to(x.dtype)
        elif x2.shape[0] <= INT8_PACKED_MAX_ROWS:
            y = _compiled(int8_rows)(x2, self.qweight, self.scale)
        else:  # many rows (prefill, large decode batches): (x @ q^T) * scale with the dtype's own GEMM
            y = torch.nn.functional.linear(x2, self.qweight.to(x.dtype)) * self.scale
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """y = x @ W^T (+ bias) with W int4 group-wise: half a byte per weight.

    On CUDA the tinygemm operator ``aten._weight_int4pack_mm`` over its packed layout (``qweight``) and
    ``scales_and_zeros``. On the CPU ``qweight`` is the group-halves layout of ``int4_rows`` (out, groups, g/2)
    with ``scale`` and ``offset`` (out, groups, 1). Products of at most ``KERNEL_MAX_ROWS`` rows run the C++ op of
    ``workbench.kernels.quant_linear_cpu`` on fp32 activations over a copy of the codes interleaved 8 rows a tile
    (``kernel_isa``; ``qweight_tiles``, ``scale_tiles``, ``offset_tiles``: attributes, as the copy below). Where
    the op did not build, products of at most ``INT8_PACKED_MAX_ROWS`` rows run torch's
    packed CPU operator ``_weight_int4pack_mm_for_cpu`` on bf16 activations where torch vectorizes it (AVX2 and up,
    ``packed_rows``: a copy of the codes in its ISA-dependent layout, ``qweight_packed``, with bf16 scales and zeros,
    attributes and not buffers: the counted format is the group-halves layout, which the copy doubles in memory
    but not in a decode's reads), else ``int4_rows`` compiled by inductor (the reference the packed path is tested
    against); more rows dequantize and run the dtype's GEMM (the packed operator took 28x the fp32 GEMM's time at
    32 rows fed fp32).
    """

    def __init__(self, linear: nn.Linear, group_size: int = DEFAULT_GROUP_SIZE) -> None:
        super().__init__()
        q, scale, zero = quantize_int4(linear.weight.detach(), group_size)
        dev, dtype = linear.weight.device, linear.weight.dtype
        self.in_features, self.out_features, self.group_size = linear.in_features, linear.out_features, group_size
        self.on_cuda = dev.type == "cuda"
        q8, offset = q.to(torch.uint8), zero - 8.0 * scale
        # (in / g, out, 2): (scale, zero) per group and output row, the layout the packed operators take
        sz = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()
        if self.on_cuda:  # two values per byte, high nibble first, then tinygemm's tiled layout
            packed = torch.ops.aten._convert_weight_to_int4pack((q8[:, ::2] << 4 | q8[:, 1::2]).to(dev),
                                                                CUDA_INT4_INNER_K_TILES)  # fmt: skip
            self.register_buffer("qweight", packed)
            self.register_buffer("scales_and_zeros", sz.to(device=dev, dtype=dtype))
        else:
            g = q8.view(self.out_features, -1, group_size)
            half = group_size // 2
            self.register_buffer("qweight", (g[..., :half] | g[..., half:] << 4).contiguous().to(dev))
            self.register_buffer("scale", scale[..., None].to(device=dev, dtype=dtype))  # (out, groups, 1)
            self.register_buffer("offset", offset[..., None].to(device=dev, dtype=dtype))
        # the CPU decode product: our op over the interleaved copy (group sizes divide by 16, as the op needs) ...
        self.kernel_isa = cpu_kernel_isa() if dev.type == "cpu" else None
        self.qweight_tiles = self.scale_tiles = self.offset_tiles = None
        if self.kernel_isa is not None:
            from workbench.kernels.quant_linear_cpu import ISAS, pack_int4

            self.kernel_isa_code = ISAS[self.kernel_isa]
            self.qweight_tiles, self.scale_tiles, self.offset_tiles = pack_int4(q, scale, offset)
        # ... else torch's packed operator over its own layout of the same codes, bf16 activations
        self.packed_rows = (
            dev.type == "cpu"
            and self.kernel_isa is None
            and cpu_packed_bf16()
            and self.out_features % INT4_PACKED_ROWS_MULTIPLE == 0
        )
        self.qweight_packed = self.scales_and_zeros_bf16 = None
        if self.packed_rows:
            # (out, in) int32 codes -> (out, in / 2) uint8 in the layout of the ISA torch runs on
            self.qweight_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
            self.scales_and_zeros_bf16 = sz.to(torch.bfloat16)  # bf16 as the activations
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (out, in) weight these codes stand for, ``(q - 8) * scale + zero`` per group, in ``dtype``."""
        if self.on_cuda:  # the operator's own product with the identity: I @ W^T
            eye = torch.eye(self.in_features, device=self.qweight.device, dtype=self.scales_and_zeros.dtype)
            wt = torch.ops.aten._weight_int4pack_mm(eye, self.qweight, self.group_size, self.scales_and_zeros)
            return wt.t().to(dtype)
        p = self.qweight
        codes = torch.cat((p & 15, p >> 4), dim=-1).to(self.scale.dtype)  # (out, groups, g)
        w = codes * self.scale + self.offset
        return w.reshape(self.out_features, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.on_cuda:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.qweight, self.group_size, self.scales_and_zeros)
        elif x2.shape[0] <= KERNEL_MAX_ROWS and self.kernel_isa is not None:
            y = torch.ops.workbench_quant.int4_linear(
                x2.float(), self.qweight_tiles, self.scale_tiles, self.offset_tiles, self.out_features,
                self.group_size, self.kernel_isa_code,
            ).to(x.dtype)  # fmt: skip
        elif x2.shape[0] > INT8_PACKED_MAX_ROWS:
            y = torch.nn.functional.linear(x2, self.dequantized_weight(x.dtype))
        elif self.packed_rows:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(torch.bfloat16).contiguous(), self.qweight_packed, self.group_size, self.scales_and_zeros_bf16
            ).to(x.dtype)
        else:
            y = _compiled(int4_rows)(x2, self.qweight, self.scale, self.offset)
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


# ---- checks before any weight is loaded, and applying it to a model ---------------------------------------------
def check_engine_quantization(
    quantization: str | None, group_size: int, dtype: torch.dtype, device: torch.device
) -> str | None:
    """The canonical scheme, or a ``ConfigError`` naming what cannot run: fp8 weights (no engine kernel), a group
    size the int4 operators do not take, int4 on CUDA without bf16, or an operator this torch build lacks for the
    device and dtype (probed on a tiny matrix, so before any weight is loaded)."""
    q = canonical_quantization(quantization)
    if q is None:
        return None
    if q not in ENGINE_QUANTIZATIONS:
        raise ConfigError(
            f"quantization {q!r} is for the roofline and the simulator; the engine runs "
            f"{', '.join(ENGINE_QUANTIZATIONS)}"
        )
    if q == "int4":
        if group_size not in INT4_GROUP_SIZES:
            raise ConfigError(
                f"int4 group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))} (what the packed int4 "
                f"operators take), got {group_size!r}"
            )
        if device.type == "cuda" and dtype != torch.bfloat16:
            raise ConfigError("int4 weights on CUDA need dtype bf16 (the tinygemm int4 kernel); use --dtype bf16")
    if device.type == "cpu":  # the CPU paths are plain tensor operations (compiled at first use): nothing to probe
        return q
    probe = nn.Linear(group_size if q == "int4" else 32, 16, bias=False, device=device, dtype=dtype)
    try:
        layer = quantize_linear(probe, q, group_size)
        layer(torch.zeros(1, probe.in_features, device=device, dtype=dtype))
    except (RuntimeError, NotImplementedError) as exc:
        first = str(exc).splitlines()[0][:160]
        where = f"{device.type} {dtype}"
        raise ConfigError(f"{q} weights need a kernel this torch build lacks for {where}: {first}") from None
    return q


def quantize_linear(
    linear: nn.Linear, quantization: str, group_size: int = DEFAULT_GROUP_SIZE, amax_reduce: AmaxReduce | None = None
) -> nn.Module:
    """The quantized replacement of one ``nn.Linear`` (``amax_reduce``: a row-parallel shard's, see
    ``quantize_int8``; int4's groups lie within a shard's columns when the group size divides them)."""
    if quantization == "int8":
        return Int8Linear(linear, amax_reduce)
    return Int4Linear(linear, group_size)


@torch.no_grad()
def quantize_model(
    model: Any, quantization: str | None, group_size: int = DEFAULT_GROUP_SIZE, amax_reduce: AmaxReduce | None = None
) -> Any:
    """Replace ``model``'s linear layers and its LM head by quantized ones, in place; returns the model. A tied head
    becomes a quantized copy of the embedding table, which stays as it is for the lookup.

    ``model`` is a ``workbench.model.transformer.Transformer`` already on its device and dtype. A tensor-parallel
    shard passes ``amax_reduce`` (the maximum over its ranks) for its row-parallel layers (O, down), so that its
    weights are the slices of the unsharded model's quantized weights.
    """
    q = check_engine_quantization(quantization, group_size, model.dtype, model.device)
    if q is None:
        return model
    model.config.check_quantization(q, group_size)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = quantize_linear(attn.qkv_proj, q, group_size)
        attn.o_proj = quantize_linear(attn.o_proj, q, group_size, amax_reduce)
        mlp.gate_up_proj = quantize_linear(mlp.gate_up_proj, q, group_size)
        mlp.down_proj = quantize_linear(mlp.down_proj, q, group_size, amax_reduce)
    model.lm_head = quantize_linear(model.lm_head, q, group_size)  # tied: a copy, the table keeps its dtype
    model.quantization, model.group_size = q, group_size
    return model


def quantized_weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters and quantized buffers that a decode reads (a tied embedding counted once)."""
    seen: set[int] = set()
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.data_ptr() in seen or name.endswith("inv_freq"):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
