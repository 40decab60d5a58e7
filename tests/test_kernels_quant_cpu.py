"""The CPU weight-only int8/int4 op (``kernels/quant_linear_cpu.py``): its packed layouts by hand, and its products
against the plain product of the weights the reference functions of ``workbench.model.quant`` dequantize, on every
code path this CPU can run (the baseline, AVX2 and, on an AVX-512 machine, AVX-512), at 1 to 32 rows."""

import pytest
import torch
from workbench.kernels.paged_decode_cpu import CpuKernelError
from workbench.kernels.testing import TOLERANCES

from workbench.kernels import quant_linear_cpu as qk
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
    # one tile of 8 rows, 64 inputs (two chunks of 32), two groups: code (r, k) = (r + k) % 16
    codes = (torch.arange(8)[:, None] + torch.arange(64)[None]) % 16
    scale = torch.arange(16.0).view(8, 2)
    packed, scale_t, offset_t = qk.pack_int4(codes, scale, torch.zeros(8, 2))
    assert packed.shape == (1, 64 * 4) and scale_t.shape == offset_t.shape == (1, 2, 8)
    assert scale_t[0, 1].tolist() == [2.0 * r + 1 for r in range(8)]  # group 1 of the 8 rows side by side
    # chunk 1 (inputs 32 .. 63), row 3, byte j: input 32 + j low, input 48 + j high
    got = packed[0, 128 + 48 : 128 + 64].tolist()
    assert got == [(3 + 32 + j) % 16 | ((3 + 48 + j) % 16) << 4 for j in range(16)]


@pytest.mark.parametrize("isa", ISAS)
# 44: a padded tile; 272: past one 256-input block; 40 and 8: an odd number of 8-input chunks (the AVX-512 loop's
# two streams over the inputs and its last chunk alone; 8: that chunk only)
@pytest.mark.parametrize("shape", [(44, 272), (8, 16), (12, 40), (8, 8)])
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
@pytest.mark.parametrize("group_size,shape", [(32, (44, 288)), (128, (24, 384)), (64, (8, 64)), (256, (8, 512))])
def test_int4_matches_the_reference(isa, group_size, shape):
    """Against ``quant.int4_op_reference`` (int8 activations at one row) at fp32's tolerance, and against the product
    of the dequantized weight within the bound of the activations' int8 step: each group's x is off by at most half its
    scale per input, so ``|y - x . w| <= sum_g xscale_g / 2 * sum_k |w_k|``."""
    need_isa(isa)
    w = _weight(*shape, seed=2)
    codes, scale, zero = quant.quantize_int4(w, group_size)
    offset = zero - 8.0 * scale
    packed, scale_t, offset_t = qk.pack_int4(codes, scale, offset)
    ref_w = quant.dequantize_int4(codes, scale, zero)
    gen = torch.Generator().manual_seed(3)
    for rows in ROWS:
        x = torch.randn(rows, shape[1], generator=gen)
        out = qk.int4_linear(x, packed, scale_t, offset_t, shape[0], group_size, isa)
        ref = quant.int4_op_reference(x, codes, scale, offset, group_size)
        torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])
        exact = x @ ref_w.T
        if rows == 1:
            xstep = x.view(-1, group_size).abs().amax(-1) / 127
            bound = (ref_w.abs().view(shape[0], -1, group_size).sum(-1) * xstep / 2).sum(-1)
            assert bool(((out - exact).abs() <= bound + 1e-6).all())
        else:
            torch.testing.assert_close(out, exact, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("isa", ISAS)
def test_int4_extreme_codes_and_inputs(isa):
    """Every code 15 and every input x = 1 (int8 code 127) in groups of 256: each row's group sum is
    15 * 127 * 256 = 487680, past int16 many times over (the AVX paths add at most 4 chunks in int16 before widening).
    By hand, over the 2 groups: y = 2 * (scale * (1 / 127) * 487680 + offset * 256)."""
    need_isa(isa)
    codes = torch.full((16, 512), 15)
    scale, offset = torch.full((16, 2), 0.5), torch.full((16, 2), -0.25)
    packed, scale_t, offset_t = qk.pack_int4(codes, scale, offset)
    out = qk.int4_linear(torch.ones(1, 512), packed, scale_t, offset_t, 16, 256, isa)
    torch.testing.assert_close(
        out, torch.full((1, 16), 15 * 256 * 2 * 0.5 - 256 * 2 * 0.25), **TOLERANCES[torch.float32]
    )


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_layers_run_the_op(scheme):
    """The layers route decode rows through the op (fp32 tolerance against the dequantized product: no bf16 on the
    way). Compiled (the op's fake kernel): tests/test_quant.py's engine runs with ``compile_decode``."""
    lin = torch.nn.Linear(64, 40, bias=True)
    layer = quant.Int8Linear(lin) if scheme == "int8" else quant.Int4Linear(lin, 32)
    assert layer.kernel_isa is not None
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))  # 2 rows: fp32 activations in both formats
    ref = x @ layer.dequantized_weight().T + lin.bias
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), ref, **TOLERANCES[torch.float32])


def test_bad_input_names_the_problem():
    with pytest.raises(CpuKernelError, match="divisible by 8"):
        qk.pack_int8(torch.zeros(8, 12, dtype=torch.int8), torch.ones(8))
    with pytest.raises(CpuKernelError, match="multiple of 32"):
        qk.pack_int4(torch.zeros(8, 48, dtype=torch.int32), torch.ones(8, 3), torch.zeros(8, 3))
    with pytest.raises(CpuKernelError, match="not supported"):
        q, s = qk.pack_int8(torch.zeros(8, 16, dtype=torch.int8), torch.ones(8))
        qk.int8_linear(torch.zeros(1, 16), q, s, 8, "sse9")
