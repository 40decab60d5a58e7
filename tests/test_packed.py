"""Packed linear layers (``workbench.model.packed``: the blocked op of ``kernels/linear_cpu.py``): the same products
as a float64 matrix product, the same weights (tied ones stay tied), only plain linears of ``PACKED_MIN_WEIGHT``
elements or more packed (the tiny presets' matrices are all smaller: tests of the packed path pack them with a
threshold of 0), what depends on packing following what was packed, and the engine's tokens with and without them."""

import pytest
import torch
from torch import nn
from workbench.kernels.testing import TOLERANCES

from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.errors import ConfigError
from workbench.hardware import cpu_vendor
from workbench.model import quant
from workbench.model.checkpoint import load_model
from workbench.model.packed import (
    PACKED_MIN_ROWS,
    PackedLinear,
    count_packed,
    pack_linears,
    packed_min_rows,
    packing_available,
    plain_linears,
    unpack_linears,
)
from workbench.request import SamplingParams

needs_op = pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.float32), reason="the blocked linear op did not build here"
)


@needs_op
@pytest.mark.parametrize("rows", [1, PACKED_MIN_ROWS, 37, 256, 257, 600])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_float64_product(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    lin = nn.Linear(192, 80, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.05, generator=gen)
        if bias:
            lin.bias.normal_(0.0, 0.05, generator=gen)
    packed = PackedLinear.wrap(lin)
    x = torch.randn(rows, 192, generator=gen)
    want = x.double() @ lin.weight.double().T + (lin.bias.double() if bias else 0.0)
    torch.testing.assert_close(packed(x).double(), want, **TOLERANCES[torch.float32])
    # leading dimensions are kept, as nn.Linear keeps them
    x3 = x.reshape(1, rows, 192)
    assert packed(x3).shape == (1, rows, 80)


@needs_op
def test_pack_linears_shares_weights_keeps_tie_and_skips_quantized():
    model = load_model("tiny-qwen2", dtype=torch.float32, device="cpu", seed=0)
    assert model.config.tie_word_embeddings
    attn = model.layers[0].self_attn
    attn.o_proj = quant.quantize_linear(attn.o_proj, "int8")
    weight = model.layers[0].mlp.down_proj.weight
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linears(model, 0) == n_linear  # every plain linear (the LM head too), not the int8 one
    assert isinstance(model.layers[0].mlp.down_proj, PackedLinear)
    assert model.layers[0].mlp.down_proj.weight is weight  # the same parameter, not a copy
    assert isinstance(attn.o_proj, quant.Int8Linear)
    assert model.lm_head.weight is model.embed_tokens.weight  # a tied head stays tied
    assert pack_linears(model, 0) == 0  # idempotent
    assert unpack_linears(model) == n_linear and type(model.layers[0].mlp.down_proj) is nn.Linear
    assert model.layers[0].mlp.down_proj.weight is weight and model.lm_head.weight is model.embed_tokens.weight
    assert not packing_available(torch.device("cpu"), torch.float16)
    assert not packing_available(torch.device("meta"), torch.float32)


@needs_op
def test_plain_linears_runs_plain_products_and_puts_the_same_packed_layers_back():
    model = load_model("tiny-gqa", dtype=torch.float32, device="cpu", seed=0)
    pack_linears(model, 0)
    before = {name: m for name, m in model.named_modules() if isinstance(m, PackedLinear)}
    calls = []
    hook = PackedLinear.forward
    PackedLinear.forward = lambda self, x: calls.append(1) or hook(self, x)  # type: ignore[method-assign]
    try:
        with plain_linears(model):
            assert not any(isinstance(m, PackedLinear) for m in model.modules())
            down = model.layers[0].mlp.down_proj
            assert type(down) is nn.Linear and down.weight is before["layers.0.mlp.down_proj"].weight
            model.prefill([[1, 2, 3, 4, 5, 6, 7, 8]], model.new_cache(1, 8), [0])
        assert calls == []  # 8 rows would take the packed product (PACKED_MIN_ROWS <= 8)
    finally:
        PackedLinear.forward = hook  # type: ignore[method-assign]
    after = {name: m for name, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)


@needs_op
def test_engine_tokens_with_and_without_packed_linears(pack_every_linear):
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [42] * 11, [5] * 3]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    tokens = {}
    model = load_model("tiny-gqa", dtype=torch.float32, device="cpu", seed=0)
    for packed in (True, False):  # one model: the second engine unpacks what the first packed
        engine = Engine(model, EngineConfig(max_num_seqs=4, max_model_len=64, packed_linears=packed))
        tokens[packed] = [r.tokens for r in engine.generate(prompts, params).requests]
        assert any(isinstance(m, PackedLinear) for m in model.modules()) is packed
    assert tokens[True] == tokens[False]


class _TwoLinears(nn.Module):
    """A stand-in for a Transformer (``pack_linears`` reads ``device`` and ``dtype``): linears of given sizes."""

    device, dtype = torch.device("cpu"), torch.float32

    def __init__(self, *shapes: tuple[int, int]) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(i, o, bias=False) for i, o in shapes)


@needs_op
def test_a_small_weight_stays_plain_and_a_large_one_is_packed_by_default():
    """PACKED_MIN_WEIGHT is 300,000 elements: tiny-gqa's largest matrix, 64 x 320 = 20,480, stays plain; SmolLM2's
    smallest, 576 x 576 = 331,776, is packed; 600 x 500 = 300,000 exactly is packed, 599 x 500 = 299,500 is not."""
    model = _TwoLinears((64, 320), (576, 576), (600, 500), (599, 500))
    assert pack_linears(model) == 2
    assert [type(m) for m in model.linears] == [nn.Linear, PackedLinear, PackedLinear, nn.Linear]
    assert count_packed(model) == 2
    assert pack_linears(model, 0) == 2 and count_packed(model) == 4  # a threshold of 0 packs the rest
    small = _TwoLinears((64, 320))
    assert pack_linears(small, 20_480) == 1 and pack_linears(_TwoLinears((64, 320)), 20_481) == 0
    with pytest.raises(ConfigError, match="min_weight must be a non-negative integer"):
        pack_linears(small, -1)


@needs_op
def test_an_engine_over_a_model_of_small_matrices_packs_nothing_and_the_fit_has_no_kernel_break():
    """tiny-gqa's matrices are all below PACKED_MIN_WEIGHT: an engine with ``packed_linears`` on leaves every linear
    plain, so the fitted profile's kernel breaks are none (with every linear packed: where packing starts)."""
    from workbench.engine.prefill_step import warmup_token_counts
    from workbench.sim.measure import engine_kernel_breaks

    model = load_model("tiny-gqa", dtype=torch.float32, device="cpu", seed=0)
    Engine(model, EngineConfig(max_num_seqs=2, max_model_len=32, packed_linears=True))
    assert count_packed(model) == 0
    assert engine_kernel_breaks(model) == () and warmup_token_counts(model) == (1, 2)
    pack_linears(model, 0)
    assert engine_kernel_breaks(model) == (PACKED_MIN_ROWS,)
    assert warmup_token_counts(model) == ((1, 2, 4) if PACKED_MIN_ROWS == 4 else (1, 2))


def test_packed_min_rows_by_vendor():
    # 1-3 rows stay plain on Intel CPUs only (MKL's matrix-vector products), packed from 1 row on elsewhere
    assert packed_min_rows("GenuineIntel") == 4
    assert packed_min_rows("AuthenticAMD") == packed_min_rows("") == 1
    assert packed_min_rows(cpu_vendor()) == PACKED_MIN_ROWS


def test_packed_linears_flag_is_a_bool():
    with pytest.raises(ConfigError, match="packed_linears must be true or false"):
        EngineConfig(packed_linears="yes")


@needs_op
def test_packed_linear_under_compile_is_the_custom_op_and_matches_float64_product():
    """Inside a compiled graph the packed product is one opaque call of the blocked op
    (``workbench_linear::blocked_linear``), with the same numbers."""
    gen = torch.Generator().manual_seed(3)
    lin = nn.Linear(96, 40, bias=True)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.05, generator=gen)
        lin.bias.normal_(0.0, 0.05, generator=gen)
    packed = PackedLinear.wrap(lin)
    x = torch.randn(37, 96, generator=gen)
    graphs = []

    def backend(gm, example_inputs):  # noqa: ANN001, ANN202
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        got = torch.compile(packed.forward, backend=backend, fullgraph=True)(x)
    assert any(n.target is torch.ops.workbench_linear.blocked_linear.default for n in graphs[0].graph.nodes)
    want = x.double() @ lin.weight.double().T + lin.bias.double()
    torch.testing.assert_close(got.double(), want, **TOLERANCES[torch.float32])
