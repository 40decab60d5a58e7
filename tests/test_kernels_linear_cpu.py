"""The CPU blocked fp32 linear op (``kernels/linear_cpu.py``): its layout by hand, and its products against a float64
matrix product, on every code path this CPU can run (the baseline, AVX2 and, on an AVX-512 machine, AVX-512), at row
counts that exercise each micro-tile's remainders, more than one task's rows and more than one chunk of inputs."""

import pytest
import torch
from torch import nn
from workbench.kernels.paged_decode_cpu import CpuKernelError
from workbench.kernels.testing import TOLERANCES

from workbench.kernels import linear_cpu as lk

pytestmark = pytest.mark.skipif(not lk.available(), reason="the CPU blocked linear op needs a C++ compiler")

ISAS = ["default", "avx2", "avx512"]


def need_isa(isa: str) -> None:
    if isa not in lk.supported_isas():
        pytest.skip(f"this CPU has no {isa} path ({torch.backends.cpu.get_cpu_capability()})")


def test_layout_by_hand():
    # 70 output rows (two blocks, the second with 58 zero columns) of 3 inputs: w (n, k) = 10 n + k
    w = (10 * torch.arange(70.0)[:, None] + torch.arange(3.0)[None]).contiguous()
    p = lk.pack(w)
    assert p.shape == (2, 3, 64) and p.is_contiguous()
    assert p[0, 2, 5].item() == 52.0  # block 0, input 2, column 5: w[5, 2]
    assert p[1, 1, :6].tolist() == [10 * n + 1 for n in range(64, 70)] and p[1, :, 6:].abs().sum() == 0


@pytest.mark.parametrize("isa", ISAS)
# rows: 1-7 (each micro-tile remainder of AVX-512's 6 rows and AVX2's 3), 13, 200 (past one task's 192 rows);
# shapes: 70 (a partial block), 1,100 inputs (three chunks of 512), 192 x 576 (SmolLM2-135M's K/V projection)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 200])
@pytest.mark.parametrize("shape", [(70, 40), (128, 1100), (192, 576)])
def test_matches_the_float64_product(isa, rows, shape):
    need_isa(isa)
    out_f, in_f = shape
    gen = torch.Generator().manual_seed(rows * 1000 + out_f)
    w = torch.randn(out_f, in_f, generator=gen) * 0.02
    bias = torch.randn(out_f, generator=gen) * 0.02
    x = torch.randn(rows, in_f, generator=gen)
    for b in (None, bias):
        got = lk.blocked_linear(x, lk.pack(w), b, out_f, isa)
        want = x.double() @ w.double().T + (0.0 if b is None else b.double())
        torch.testing.assert_close(got.double(), want, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("isa", ISAS)
def test_no_rows_and_no_inputs(isa):
    need_isa(isa)
    w = torch.randn(64, 8)
    assert lk.blocked_linear(torch.empty(0, 8), lk.pack(w), None, 64, isa).shape == (0, 64)
    bias = torch.arange(64.0)
    # no inputs: the product is the bias (zeros without one), as for F.linear
    got = lk.blocked_linear(torch.empty(3, 0), lk.pack(torch.empty(64, 0)), bias, 64, isa)
    assert torch.equal(got, bias.expand(3, 64)) and lk.blocked_linear(torch.empty(2, 0), lk.pack(torch.empty(64, 0)),
                                                                      None, 64, isa).abs().sum() == 0  # fmt: skip


def test_bad_inputs_are_named():
    w = torch.randn(64, 8)
    isa = lk.default_isa()
    with pytest.raises(CpuKernelError, match="packs a 2-D fp32 weight"):
        lk.pack(w.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"packed weight must be \(1, 16, 64\)"):
        lk.blocked_linear(torch.randn(2, 16), lk.pack(w), None, 64, isa)
    with pytest.raises(RuntimeError, match="x must be"):
        lk.blocked_linear(torch.randn(2, 8, dtype=torch.float64), lk.pack(w), None, 64, isa)
    with pytest.raises(RuntimeError, match="bias must be"):
        lk.blocked_linear(torch.randn(2, 8), lk.pack(w), torch.randn(63), 64, isa)
    with pytest.raises(CpuKernelError, match="not supported on this CPU"):
        lk.blocked_linear(torch.randn(2, 8), lk.pack(w), None, 64, "sse9")


def test_a_packed_layer_runs_the_forced_code_path(monkeypatch):
    """``WORKBENCH_CPU_ISA`` picks the path a layer packed afterwards runs (here the AVX2 one, where the CPU has it),
    with the same numbers as the float64 product."""
    from workbench.model.packed import PackedLinear

    forced = "avx2" if "avx2" in lk.supported_isas() else "default"
    monkeypatch.setenv("WORKBENCH_CPU_ISA", forced)
    lin = nn.Linear(96, 80)
    layer = PackedLinear.wrap(lin)
    assert layer.isa == lk.ISAS[forced]
    x = torch.randn(9, 96)
    with torch.no_grad():
        want = x.double() @ lin.weight.double().T + lin.bias.double()
        torch.testing.assert_close(layer(x).double(), want, **TOLERANCES[torch.float32])
