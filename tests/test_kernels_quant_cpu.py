"""The CPU weight-only int8/int4 op (``kernels.quant_linear_cpu``): its packed layouts by hand, and its products
against the plain product of the weights the reference functions of ``workbench.model.quant`` dequantize, on every
code path this CPU can run (the baseline, AVX2 and, on an AVX-512 machine, AVX-512), at 1 to 32 rows."""

import pytest
import torch

from kernels import quant_linear_cpu as qk
from kernels.paged_decode_cpu import CpuKernelError
from kernels.testing import TOLERANCES
from workbench.model import quant

pytestmark = pytest.mark.skipif(not qk.available(), reason="the CPU quantized linear op needs a C++ compiler")

ISAS = ["default", "avx2", "avx512"]
ROWS = [1, 3, 32]  # one row (the register path), several (the dequantized-block path)


def need_isa(isa: str) -> None:
    if isa not in qk.supported_isas():
        pytest.skip(f"this CPU has no {isa} path ({torch.backends.cpu.get_cpu_capability()})")


def _weight(out_f: int, in_f: int, seed: int) -> torch.Tensor:
    return torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 0.02


def test_int8_layout_by_hand():
    # 9 rows (two tiles, the second padded with zero rows) of 16 inputs: code (r, k) = r * 16 + k - 72
    q = (torch.arange(9 * 16) - 72).view(9, 16).to(torch.int8)
    packed, scale = qk.pack_int8(q, torch.ones(9))
    assert packed.shape == (2, 16 * 8) and scale.shape == (16,)
    # tile 0, chunk 1 (inputs 8 .. 15), row 2: bytes 64 + 16 .. 64 + 23
    assert packed[0, 64 + 16 : 64 + 24].tolist() == [2 * 16 + k - 72 for k in range(8, 16)]
    assert packed[1, :8].tolist() == [8 * 16 + k - 72 for k in range(8)] and packed[1, 8:64].abs().sum() == 0


def test_int4_layout_by_hand():
    # one tile of 8 rows, 32 inputs (two chunks of 16), one group: code (r, k) = (r + k) % 16
    codes = (torch.arange(8)[:, None] + torch.arange(32)[None]) % 16
    packed, scale, offset = qk.pack_int4(codes, torch.ones(8, 1), torch.zeros(8, 1))
    assert packed.shape == (1, 32 * 4) and scale.shape == offset.shape == (1, 1, 8)
    # chunk 1 (inputs 16 .. 31), row 3, byte j: input 16 + j low, input 24 + j high
    got = packed[0, 64 + 24 : 64 + 32].tolist()
    assert got == [(3 + 16 + j) % 16 | ((3 + 24 + j) % 16) << 4 for j in range(8)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(44, 272), (8, 16)])  # 44: a padded tile; 272: past one 256-input block
def test_int8_matches_the_dequantized_product(isa, shape):
    need_isa(isa)
    w = _weight(*shape, seed=0)
    q, scale = quant.quantize_int8(w)
    packed, scale_t = qk.pack_int8(q, scale)
    ref_w = quant.dequantize_int8(q, scale)
    gen = torch.Generator().manual_seed(1)
    for rows in ROWS:
        x = torch.randn(rows, shape[1], generator=gen)
        out = qk.int8_linear(x, packed, scale_t, shape[0], isa)
        torch.testing.assert_close(out, x @ ref_w.T, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group_size,shape", [(32, (44, 288)), (128, (24, 384)), (16, (8, 16))])
def test_int4_matches_the_dequantized_product(isa, group_size, shape):
    need_isa(isa)
    w = _weight(*shape, seed=2)
    codes, scale, zero = quant.quantize_int4(w, group_size)
    packed, scale_t, offset_t = qk.pack_int4(codes, scale, zero - 8.0 * scale)
    ref_w = quant.dequantize_int4(codes, scale, zero)
    gen = torch.Generator().manual_seed(3)
    for rows in ROWS:
        x = torch.randn(rows, shape[1], generator=gen)
        out = qk.int4_linear(x, packed, scale_t, offset_t, shape[0], group_size, isa)
        torch.testing.assert_close(out, x @ ref_w.T, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_layers_on_the_op_eager_and_compiled(scheme):
    """The layers route decode rows through the op (fp32 tolerance against the dequantized product: no bf16 on the
    way), and ``torch.compile`` keeps the op as one call (its fake kernel gives the shape)."""
    lin = torch.nn.Linear(64, 40, bias=True)
    layer = quant.Int8Linear(lin) if scheme == "int8" else quant.Int4Linear(lin, 32)
    assert layer.kernel_isa is not None
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    ref = x @ layer.dequantized_weight().T + lin.bias
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), ref, **TOLERANCES[torch.float32])
        compiled = torch.compile(layer, fullgraph=True)
        torch.testing.assert_close(compiled(x), ref, **TOLERANCES[torch.float32])


def test_bad_input_names_the_problem():
    with pytest.raises(CpuKernelError, match="divisible by 8"):
        qk.pack_int8(torch.zeros(8, 12, dtype=torch.int8), torch.ones(8))
    with pytest.raises(CpuKernelError, match="multiple of 16"):
        qk.pack_int4(torch.zeros(8, 24, dtype=torch.int32), torch.ones(8, 3), torch.zeros(8, 3))
    with pytest.raises(CpuKernelError, match="not supported"):
        q, s = qk.pack_int8(torch.zeros(8, 16, dtype=torch.int8), torch.ones(8))
        qk.int8_linear(torch.zeros(1, 16), q, s, 8, "sse9")
