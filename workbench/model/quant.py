"""Weight-only quantization of the linear layers: int8 per output channel, int4 group-wise, applied at load time.

Formats (the bytes ``workbench.config.quantized_matrix_bytes`` counts):

- **int8**, symmetric per output channel: ``scale[n] = max_k |w[n, k]| / 127``, ``q = round(w / scale)`` in
  [-127, 127]; ``w ~= q * scale``. Matrix product: ``torch.ops.aten._weight_int8pack_mm(x, q, scale)``.
- **int4**, asymmetric group-wise along the input (``group_size`` inputs share a pair): with the group's min and
  max, ``scale = (max - min) / 15``, ``q = round((w - min) / scale)`` in [0, 15], ``zero = min + 8 * scale``, and
  ``w ~= (q - 8) * scale + zero`` (the tinygemm convention). Matrix product: ``_weight_int4pack_mm_for_cpu`` on the
  CPU, ``_weight_int4pack_mm`` (bf16 only) on CUDA, each over its own packed layout.

What is quantized: the linear layers of every decoder layer (the fused qkv, o, fused gate/up, down) and an untied
LM head. A tied LM head shares the embedding table, which stays in the activation dtype: it is also a lookup
table read one row per token, and quantizing it would change the embeddings as well as the logits. Norms and
biases stay in the activation dtype (``ModelConfig.weight_bytes`` counts the same split).

Why torch's own operators and not torchao: torchao 0.18 installs beside torch 2.13 without moving it, but its
weight-only int8/int4 paths on the CPU end in these same ``aten`` operators; calling them directly keeps the
engine's dependencies to what the GPU machine has (torch, triton, transformers), keeps the packed layout in one
visible place, and lets ``torch.compile`` see plain operators. Nothing here is a kernel of our own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workbench.config import DEFAULT_GROUP_SIZE, canonical_quantization
from workbench.errors import ConfigError

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the packed int4 operators accept
# Above this many rows an int8 product dequantizes the weight and runs the activation dtype's GEMM instead: on this
# 2-core AVX-512 CPU (torch 2.13), ``_weight_int8pack_mm`` took 13.6x the fp32 GEMM's time at 32 rows of a
# 5632 x 1024 matrix (0.34 s against 0.025 s, same run), while at 1 row it was on a par with it.
INT8_PACKED_MAX_ROWS = 4  # (int4 likewise, see Int4Linear)
ENGINE_QUANTIZATIONS = ("int8", "int4")  # fp8 weights: roofline and simulator only (no CPU fp8 matmul here)
CUDA_INT4_INNER_K_TILES = 8


# ---- quantize / dequantize (the references the packed operators are checked against) --------------------------
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (q int8 (out, in), scale fp32 (out,)), symmetric per output channel."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # an all-zero row gets a tiny scale and q = 0
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


# ---- the quantized linear layers ---------------------------------------------------------------------------------
class Int8Linear(nn.Module):
    """y = x @ (q * scale)^T (+ bias) through ``aten._weight_int8pack_mm``: 1 byte per weight read."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        q, scale = quantize_int8(linear.weight.detach())
        dev, dtype = linear.weight.device, linear.weight.dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", q.to(dev))  # (out, in) int8
        self.register_buffer("scale", scale.to(device=dev, dtype=dtype))  # (out,) activation dtype
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] <= INT8_PACKED_MAX_ROWS or x.device.type != "cpu":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale)
        else:  # many rows (prefill, large decode batches): (x @ q^T) * scale with the dtype's own GEMM
            y = torch.nn.functional.linear(x2, self.qweight.to(x.dtype)) * self.scale
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """y = x @ W^T (+ bias) with W int4 group-wise, packed for the device's int4 operator: half a byte per weight."""

    def __init__(self, linear: nn.Linear, group_size: int = DEFAULT_GROUP_SIZE) -> None:
        super().__init__()
        q, scale, zero = quantize_int4(linear.weight.detach(), group_size)
        dev, dtype = linear.weight.device, linear.weight.dtype
        self.in_features, self.out_features, self.group_size = linear.in_features, linear.out_features, group_size
        self.on_cuda = dev.type == "cuda"
        if self.on_cuda:  # two values per byte, high nibble first, then tinygemm's tiled layout
            q8 = q.to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack((q8[:, ::2] << 4 | q8[:, 1::2]).to(dev),
                                                                CUDA_INT4_INNER_K_TILES)  # fmt: skip
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # (out, in / 2) uint8
        self.register_buffer("qweight", packed)
        # the codes again, two per byte in plain order, for products of many rows (prefill, large batches): the
        # packed CPU operator took 28x the fp32 GEMM's time at 32 rows (0.69 s against 0.025 s for 5632 x 1024),
        # so those rows dequantize and run the dtype's GEMM. Decode (<= INT8_PACKED_MAX_ROWS rows) never reads it;
        # it is the price in memory (0.5 byte per weight) of a usable prefill
        rows = None
        if not self.on_cuda:
            q8 = q.to(torch.uint8)
            rows = (q8[:, ::2] << 4 | q8[:, 1::2]).to(dev)  # (out, in / 2) uint8
        self.register_buffer("qweight_rows", rows)
        # (in / g, out, 2): the layout both operators take, in the activation dtype
        sz = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", sz.to(device=dev, dtype=dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (out, in) weight these codes stand for, ``(q - 8) * scale + zero`` per group, in ``dtype``."""
        p = self.qweight_rows
        q = torch.stack((p >> 4, p & 15), dim=-1).view(self.out_features, -1, self.group_size)  # (out, groups, g)
        sz = self.scales_and_zeros.transpose(0, 1)  # (out, groups, 2)
        w = (q.to(sz.dtype) - 8) * sz[..., :1] + sz[..., 1:]
        return w.view(self.out_features, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.on_cuda:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.qweight, self.group_size, self.scales_and_zeros)
        elif x2.shape[0] > INT8_PACKED_MAX_ROWS:
            y = torch.nn.functional.linear(x2, self.dequantized_weight(x.dtype))
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size, self.scales_and_zeros)
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
    probe = nn.Linear(group_size if q == "int4" else 32, 16, bias=False, device=device, dtype=dtype)
    try:
        layer = quantize_linear(probe, q, group_size)
        layer(torch.zeros(1, probe.in_features, device=device, dtype=dtype))
    except (RuntimeError, NotImplementedError) as exc:
        first = str(exc).splitlines()[0][:160]
        where = f"{device.type} {dtype}"
        raise ConfigError(f"{q} weights need a kernel this torch build lacks for {where}: {first}") from None
    return q


def quantize_linear(linear: nn.Linear, quantization: str, group_size: int = DEFAULT_GROUP_SIZE) -> nn.Module:
    """The quantized replacement of one ``nn.Linear``."""
    if quantization == "int8":
        return Int8Linear(linear)
    return Int4Linear(linear, group_size)


@torch.no_grad()
def quantize_model(model: Any, quantization: str | None, group_size: int = DEFAULT_GROUP_SIZE) -> Any:
    """Replace ``model``'s linear layers (and an untied LM head) by quantized ones, in place; returns the model.

    ``model`` is a ``workbench.model.transformer.Transformer`` already on its device and dtype.
    """
    q = check_engine_quantization(quantization, group_size, model.dtype, model.device)
    if q is None:
        return model
    model.config.check_quantization(q, group_size)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = quantize_linear(attn.qkv_proj, q, group_size)
        attn.o_proj = quantize_linear(attn.o_proj, q, group_size)
        mlp.gate_up_proj = quantize_linear(mlp.gate_up_proj, q, group_size)
        mlp.down_proj = quantize_linear(mlp.down_proj, q, group_size)
    if not model.config.tie_word_embeddings:
        model.lm_head = quantize_linear(model.lm_head, q, group_size)
    model.quantization, model.group_size = q, group_size
    return model


def quantized_weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters and quantized buffers that a decode reads (a tied embedding counted once;
    int4's plain-order copy of its codes, read only by products of many rows, left out)."""
    seen: set[int] = set()
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.data_ptr() in seen or name.endswith(("inv_freq", "qweight_rows")):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
