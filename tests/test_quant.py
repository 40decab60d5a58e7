"""Weight-only quantization (int8 per channel, int4 group-wise) and the quantized KV cache (int8, fp8).

Round trips against values computed by hand; the packed operators against a plain matrix product of the
dequantized weights; the quantized engine's greedy tokens against transformers running the same dequantized
weights; the quantized KV pool's two read paths against attention over K/V quantized by hand; bad input.
"""

import pytest
import torch
from torch import nn
from workbench.kernels.testing import TOLERANCES

from workbench.config import ModelConfig
from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.errors import ConfigError
from workbench.kv.cache import KVCache, quantize_kv_int8
from workbench.model import quant
from workbench.model.attention import TORCH_BACKEND, build_decode_metadata
from workbench.request import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [42] * 11]


# ---- round trips by hand -----------------------------------------------------------------------------------------
def test_int8_quantize_by_hand():
    w = torch.tensor([[1.0, -2.0, 0.5, 4.0], [0.0, 0.0, 0.0, 0.0], [-1.27, 0.635, 0.0, 0.01]])
    q, scale = quant.quantize_int8(w)
    # row 0: scale 4/127; 127/4 * (1, -2, 0.5, 4) = (31.75, -63.5, 15.875, 127) -> 32, -64 (half to even), 16, 127
    # row 2: scale 0.01; (-127, 63.5, 0, 1) -> -127, 64 (half to even), 0, 1
    assert q.tolist() == [[32, -64, 16, 127], [0, 0, 0, 0], [-127, 64, 0, 1]]
    assert scale[0].item() == pytest.approx(4 / 127) and scale[2].item() == pytest.approx(0.01)
    back = quant.dequantize_int8(q, scale)
    assert back[0].tolist() == pytest.approx([32 * 4 / 127, -64 * 4 / 127, 16 * 4 / 127, 4.0])
    assert back[1].abs().max().item() == 0.0


def test_int4_quantize_by_hand():
    # one row, two groups of 4: (0, 1, 2, 3) and (-1, -1, 1, 2)
    w = torch.tensor([[0.0, 1.0, 2.0, 3.0, -1.0, -1.0, 1.0, 2.0]])
    q, scale, zero = quant.quantize_int4(w, group_size=4)
    # group 0: min 0, scale 3/15 = 0.2, q = w / 0.2 = 0, 5, 10, 15; zero = 0 + 8 * 0.2 = 1.6
    # group 1: min -1, scale 3/15 = 0.2, q = (w + 1) / 0.2 = 0, 0, 10, 15; zero = -1 + 1.6 = 0.6
    assert q.tolist() == [[0, 5, 10, 15, 0, 0, 10, 15]]
    assert scale.tolist() == [pytest.approx([0.2, 0.2])]
    assert zero.tolist() == [pytest.approx([1.6, 0.6])]
    assert quant.dequantize_int4(q, scale, zero).tolist() == [pytest.approx(w[0].tolist(), abs=1e-6)]


def test_kv_int8_quantize_by_hand():
    x = torch.tensor([[[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]]])  # (T=1, heads=2, d=3)
    q, scale = quantize_kv_int8(x)
    # head 0: scale 1/127; (63.5, -127, 31.75) -> 64 (half to even), -127, 32; head 1 (all zero): scale 1, q 0
    assert q.tolist() == [[[64, -127, 32], [0, 0, 0]]]
    assert scale.tolist() == [[pytest.approx(1 / 127), 1.0]]


# ---- the products against a plain product of the dequantized weights -------------------------------------------
@pytest.mark.parametrize("rows", [1, 4, 5])  # the fused dequantize-reduce loop (<= 4 rows), and the GEMM path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_dequantized_matmul(dtype, rows):
    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(96, 40, bias=True).to(dtype)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    layer = quant.Int8Linear(lin)
    ref = x.float() @ layer.dequantized_weight().T + lin.bias.float()
    # the CPU decode product of an AVX2/AVX-512 CPU feeds torch's int8 kernel bf16 activations: bf16's tolerance
    bf16 = rows <= quant.INT8_PACKED_MAX_ROWS and layer.bf16_rows
    torch.testing.assert_close(layer(x).float(), ref, **TOLERANCES[torch.bfloat16 if bf16 else dtype])


def test_int8_bf16_rows_follow_the_cpu(monkeypatch):
    monkeypatch.setenv("WORKBENCH_QUANT_KERNEL", "0")  # torch's operators, as where the C++ op does not build
    lin = nn.Linear(64, 8, bias=False)
    layer = quant.Int8Linear(lin)
    assert layer.bf16_rows == (torch.backends.cpu.get_cpu_capability() in quant.INT8_BF16_CAPABILITIES)
    assert layer.bf16_rows == (layer.scale_bf16 is not None)


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_matches_dequantized_matmul(group_size, dtype):
    gen = torch.Generator().manual_seed(1)
    lin = nn.Linear(256, 48, bias=False)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.02, generator=gen)
    layer = quant.Int4Linear(lin.to(dtype), group_size)
    q, scale, zero = quant.quantize_int4(lin.weight, group_size)
    w = quant.dequantize_int4(q, scale, zero)  # from the hand-checked reference functions, not the layer's layout
    torch.testing.assert_close(layer.dequantized_weight(), w, **TOLERANCES[dtype])
    for rows in (1, 3, 9):  # the C++ op or packed operator (or fused loop) of few rows, the dequantized GEMM of many
        x = torch.randn(rows, 256, generator=gen).to(dtype)
        bf16 = rows <= quant.INT8_PACKED_MAX_ROWS and layer.packed_rows  # bf16 activations: bf16's tolerance
        ref = x.float() @ w.T
        if rows == 1 and layer.kernel_isa is not None:  # the C++ op quantizes one row of x to int8 per group
            ref = quant.int4_op_reference(x.float(), q, scale, zero - 8.0 * scale, group_size)
        torch.testing.assert_close(layer(x).float(), ref, **TOLERANCES[torch.bfloat16 if bf16 else dtype])
    # the error of the format itself: at most half a step of the group's scale per weight
    err = (w - lin.weight.float()).abs()
    assert bool((err <= scale.repeat_interleave(group_size, dim=1) / 2 + 1e-7).all())


def _int4_layer(out_f: int, in_f: int, group_size: int, seed: int) -> tuple[nn.Linear, "quant.Int4Linear"]:
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(in_f, out_f, bias=False)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.02, generator=gen)
    return lin, quant.Int4Linear(lin, group_size)


def test_cpu_decode_products_take_the_kernel_where_it_builds():
    """Where the C++ op builds, the CPU layers carry its interleaved copies and not torch's packed ones."""
    from workbench.kernels import quant_linear_cpu

    if not quant_linear_cpu.available():
        pytest.skip(f"the C++ op did not build: {quant_linear_cpu.build_error()}")
    lin = nn.Linear(64, 24, bias=False)
    int8, int4 = quant.Int8Linear(lin), quant.Int4Linear(lin, 32)
    assert int8.kernel_isa == int4.kernel_isa == quant_linear_cpu.default_isa()
    assert not int8.bf16_rows and not int4.packed_rows and int4.qweight_packed is None
    assert int8.qweight_tiles.shape == (3, 64 * 8) and int4.qweight_tiles.shape == (3, 64 * 4)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_packed_rows_match_the_group_halves_loop(group_size, monkeypatch):
    """The CPU decode product through torch's packed int4 operator (bf16 activations) against ``int4_rows`` over the
    group-halves layout, run eagerly (the reference it replaced), at 1 to 4 rows, and against the product of the
    weight the hand-checked reference functions dequantize; bf16's tolerance (x, the scales and y are bf16). The
    fallback where the C++ op of ``workbench.kernels.quant_linear_cpu`` does not build."""
    monkeypatch.setenv("WORKBENCH_QUANT_KERNEL", "0")
    lin, layer = _int4_layer(48, 256, group_size, seed=3)
    assert layer.packed_rows == quant.cpu_packed_bf16()  # 48 output rows: a multiple of 16
    if not layer.packed_rows:
        pytest.skip(f"torch has no vectorized packed int4 kernel on {torch.backends.cpu.get_cpu_capability()}")
    assert layer.qweight_packed.shape == (48, 128) and layer.scales_and_zeros_bf16.shape == (256 // group_size, 48, 2)
    w = quant.dequantize_int4(*quant.quantize_int4(lin.weight, group_size))
    gen = torch.Generator().manual_seed(4)
    for rows in range(1, quant.INT8_PACKED_MAX_ROWS + 1):
        x = torch.randn(rows, 256, generator=gen)
        loop = quant.int4_rows(x, layer.qweight, layer.scale, layer.offset)  # eager: (rows, out, in) in memory
        torch.testing.assert_close(loop, x @ w.T, **TOLERANCES[torch.float32])
        torch.testing.assert_close(layer(x), loop, **TOLERANCES[torch.bfloat16])


def test_int4_packed_rows_need_output_rows_in_sixteens(monkeypatch):
    monkeypatch.setenv("WORKBENCH_QUANT_KERNEL", "0")
    _, layer = _int4_layer(40, 64, 32, seed=5)  # 40 rows: the packed operator takes multiples of 16
    assert not layer.packed_rows and layer.qweight_packed is None  # decode runs int4_rows (checked above)


AVX2_CHECK = """
import torch
from torch import nn
from workbench.kernels.testing import TOLERANCES
from workbench.model import quant
assert torch.backends.cpu.get_cpu_capability() == "AVX2", torch.backends.cpu.get_cpu_capability()
gen = torch.Generator().manual_seed(7)
lin = nn.Linear(128, 32, bias=False)
with torch.no_grad():
    lin.weight.normal_(0.0, 0.02, generator=gen)
for group_size in (32, 64, 128):
    layer = quant.Int4Linear(lin, group_size)
    assert layer.packed_rows
    for rows in (1, 4):
        x = torch.randn(rows, 128, generator=gen)
        ref = quant.int4_rows(x, layer.qweight, layer.scale, layer.offset)
        torch.testing.assert_close(layer(x), ref, **TOLERANCES[torch.bfloat16])
int8 = quant.Int8Linear(lin)
assert int8.bf16_rows
x = torch.randn(2, 128, generator=gen)
torch.testing.assert_close(int8(x), x @ int8.dequantized_weight().T, **TOLERANCES[torch.bfloat16])
print("ok")
"""


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="this CPU runs the AVX2 path itself")
def test_packed_rows_on_the_avx2_path_of_an_avx512_cpu():
    """torch's packed layouts and kernels differ by ISA (32 output rows interleaved on AVX2, 64 on AVX-512): an
    AVX-512 machine forces the AVX2 path in a fresh process (``ATEN_CPU_CAPABILITY`` is read at torch's import).
    The fallback where the C++ op does not build (its own AVX2 path: tests/test_kernels_quant_cpu.py)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "WORKBENCH_QUANT_KERNEL": "0"}
    done = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_int4_group_halves_layout_by_hand():
    # one row, one group of 32 codes: (3, 10, 15, 0) x 4 then (1, 2, 0, 15) x 4; byte j holds code j (low nibble)
    # and code j + 16 (high nibble)
    lin = nn.Linear(32, 1, bias=False)
    codes = torch.tensor([3, 10, 15, 0] * 4 + [1, 2, 0, 15] * 4, dtype=torch.float32)
    with torch.no_grad():
        lin.weight.copy_(codes[None] * 0.1)  # every group of 32 spans 0 .. 1.5: scale 0.1, codes as given
    layer = quant.Int4Linear(lin, group_size=32)
    assert layer.qweight.shape == (1, 1, 16)
    assert layer.qweight[0, 0, :4].tolist() == [3 | 1 << 4, 10 | 2 << 4, 15 | 0 << 4, 0 | 15 << 4]
    x = torch.ones(1, 32)
    assert layer(x).item() == pytest.approx(codes.sum().item() * 0.1, rel=1e-5)


# ---- the engine against transformers on the same dequantized weights -----------------------------------------
def _dequantize_hf(hf, scheme: str, group_size: int) -> None:
    """Replace every linear of an HF model and its LM head by its quantize -> dequantize round trip; a tied head is
    untied first (the embedding table keeps its weights, as the engine's lookup does)."""
    if hf.config.tie_word_embeddings:
        hf.lm_head.weight = nn.Parameter(hf.lm_head.weight.detach().clone(), requires_grad=False)
    with torch.no_grad():
        for mod in hf.modules():
            if isinstance(mod, nn.Linear):
                if scheme == "int8":
                    mod.weight.copy_(quant.dequantize_int8(*quant.quantize_int8(mod.weight)))
                else:
                    mod.weight.copy_(quant.dequantize_int4(*quant.quantize_int4(mod.weight, group_size)))


def _assert_near_argmax_of_the_peer(hf, prompts, got, tol) -> None:
    """Every token the engine chose is the peer's argmax within ``tol`` given the same prefix (the peer
    teacher-forced on the engine's own tokens): ``logit[token] >= max - (atol + rtol * |max|)``."""
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]  # (len(tokens), vocab)
        best = logits.max(dim=-1).values
        chosen = logits[torch.arange(len(tokens)), torch.tensor(tokens)]
        assert bool((chosen >= best - (tol["atol"] + tol["rtol"] * best.abs())).all()), (prompt, tokens)


@pytest.mark.parametrize(
    "preset,scheme,compiled",  # compiled: the engine's compiled decode step, the fused loops inside its graph
    [("tiny-gqa", "int8", False), ("tiny-gqa", "int4", False), ("tiny-qwen2", "int8", False),
     ("tiny-qwen2", "int4", False), ("tiny-gqa", "int8", True), ("tiny-gqa", "int4", True)],
)  # fmt: skip
def test_quantized_engine_tokens_equal_transformers_on_dequantized_weights(tiny_checkpoint, preset, scheme, compiled):
    import transformers

    path = tiny_checkpoint(preset)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    _dequantize_hf(hf, scheme, 32)
    expected = []
    for p in PROMPTS:
        out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=6,
                          min_new_tokens=6, do_sample=False, pad_token_id=0)  # fmt: skip
        expected.append(out[0, len(p) :].tolist())
    cfg = EngineConfig(quantization=scheme, group_size=32, block_size=4, device="cpu", max_model_len=64,
                       compile_decode=compiled)  # fmt: skip
    engine = Engine.from_model(str(path), cfg)
    got = [r.tokens for r in engine.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True)).requests]
    if got != expected:  # CPU decode products: bf16 or (int4 op) int8 activations; a near-tie may go the other way
        _assert_near_argmax_of_the_peer(hf, PROMPTS, got, TOLERANCES[torch.bfloat16])
    if compiled:
        assert engine.decode.compiled_sizes  # pure decodes went through the compiled step
    assert engine.ledger.weight_bytes == engine.model.config.weight_bytes("fp32", scheme, 32)
    assert quant.quantized_weight_bytes(engine.model) == engine.ledger.weight_bytes  # what is held = what is counted


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_tied_head_is_a_quantized_copy_within_the_format_bound(scheme):
    """A tied head becomes a quantized copy of the table; the lookup keeps the table bit for bit. Each logit of the
    copy is within the format's own bound of the table's: every weight is off by at most half a step of its scale,
    so ``|y_n - x . w_n| <= sum_k |x_k| * step_nk / 2``, plus bf16's tolerance (the decode product's activations)."""
    from workbench.model.checkpoint import load_model

    model = load_model("tiny-qwen2")  # tied: hidden 64, vocab 256
    table = model.embed_tokens.weight.detach().clone()
    quant.quantize_model(model, scheme, 32)
    assert isinstance(model.lm_head, (quant.Int8Linear, quant.Int4Linear))  # the head reads its copy ...
    torch.testing.assert_close(model.embed_tokens.weight, table, rtol=0, atol=0)  # ... the lookup the table
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(8))
    if scheme == "int8":
        step = (table.abs().amax(dim=1) / 127)[:, None].expand_as(table)
    else:
        _, scale, _ = quant.quantize_int4(table, 32)
        step = scale.repeat_interleave(32, dim=1)
    exact = x @ table.T
    bound = x.abs() @ (step / 2).T
    tol = TOLERANCES[torch.bfloat16]
    err = (model.compute_logits(x) - exact).abs()
    assert bool((err <= bound + tol["atol"] + tol["rtol"] * exact.abs()).all()), float((err - bound).max())


# ---- the quantized KV cache ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_pool_decode_reads_equal_attention_over_hand_quantized_kv(kv_dtype):
    cfg = ModelConfig.resolve("tiny-gqa")  # 4 query heads, 2 KV heads of 16
    gen = torch.Generator().manual_seed(2)
    cache = KVCache(cfg, num_blocks=6, block_size=4, kv_cache_dtype=kv_dtype)
    n_ctx = 9  # cached keys, ending mid-block, in blocks 5, 1, 3
    table = [5, 1, 3]
    slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(n_ctx)])
    k, v = torch.randn(2, n_ctx, 2, 16, generator=gen).unbind(0)
    cache.write(slots, k, v, layer=1)
    q, k_new, v_new = torch.randn(3, 1, 4, 16, generator=gen).unbind(0)
    k_new, v_new = k_new[:, :2], v_new[:, :2]

    def by_hand(x):  # the format's own definition, written out
        if kv_dtype == "int8":
            s = x.abs().amax(-1, keepdim=True) / 127
            return torch.round(x / s).clamp(-127, 127) * s
        return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()  # scale 1.0

    kk = torch.cat((by_hand(k), by_hand(k_new)))  # (n_ctx + 1, 2, 16)
    vv = torch.cat((by_hand(v), by_hand(v_new)))
    ref = nn.functional.scaled_dot_product_attention(  # query heads 2j, 2j+1 read KV head j
        q.view(1, 2, 2, 16), kk.transpose(0, 1)[None], vv.transpose(0, 1)[None], scale=0.25
    ).reshape(1, 4, 16)
    meta = build_decode_metadata([n_ctx + 1], [table], 4)
    out = TORCH_BACKEND.decode(1, q, k_new, v_new, cache, meta, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the ragged path reads the pool through DequantView after writing the new token: the same attention
    cache.write(meta.slot_mapping, k_new, v_new, layer=1)
    k_view, v_view = (views[1] for views in cache.layer_views())
    torch.testing.assert_close(k_view[torch.tensor(table)].reshape(-1, 2, 16)[: n_ctx + 1], kk, atol=1e-6, rtol=0)
    torch.testing.assert_close(v_view[torch.tensor(table)].reshape(-1, 2, 16)[: n_ctx + 1], vv, atol=1e-6, rtol=0)


def test_int8_kv_pool_bytes_and_sequences_that_fit():
    cfg = ModelConfig.resolve("tiny-gqa")  # 2 layers, 2 KV heads of 16
    assert KVCache(cfg, 2, 4, kv_cache_dtype="int8").bytes_per_token == 2 * 2 * 2 * (16 + 4)
    assert KVCache(cfg, 2, 4, kv_cache_dtype="fp8").bytes_per_token == 2 * 2 * 2 * 16
    assert KVCache(cfg, 2, 4).bytes_per_token == 2 * 2 * 2 * 16 * 4
    budget = 1 << 20
    plain = EngineConfig(kv_cache_bytes=budget, block_size=16).cache_shape(cfg)[0]
    int8 = EngineConfig(kv_cache_bytes=budget, block_size=16, kv_cache_dtype="int8").cache_shape(cfg)[0]
    assert plain == budget // (16 * 512) and int8 == budget // (16 * 160)  # 512 and 160 bytes per token


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_kv_quantized_engine_paths_agree(tiny_checkpoint, kv_dtype):
    """Eager decode (gather), ragged steps only (DequantView), a one-token-per-block pool and the
    dequantizing Triton decode kernel (under the interpreter) give the same greedy tokens."""
    path = str(tiny_checkpoint("tiny-gqa"))
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    variants = {"eager": {}, "chunked": {"policy": "chunked", "token_budget": 4}, "bs1": {"block_size": 1},
                "triton": {"attention_backend": "triton"}}  # fmt: skip
    runs = {}
    for name, kw in variants.items():
        cfg = EngineConfig(kv_cache_dtype=kv_dtype, device="cpu", max_model_len=64, **kw)
        runs[name] = [r.tokens for r in Engine.from_model(path, cfg).generate(PROMPTS, sp).requests]
    assert all(tokens == runs["eager"] for tokens in runs.values()), runs


# ---- bad input -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"quantization": "int3"}, "unknown quantization"),
        ({"quantization": "fp8"}, "roofline and the simulator"),
        ({"kv_cache_dtype": "int4"}, "unknown kv cache dtype"),
        ({"quantization": "int4", "group_size": 0}, "group_size must be a positive integer"),
    ],
)
def test_engine_config_quantization_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kwargs)


def test_group_size_errors_come_before_any_weight_is_loaded(monkeypatch):
    import workbench.model.checkpoint as ckpt

    def no_load(*a, **k):
        raise AssertionError("weights were loaded before the check")

    monkeypatch.setattr(ckpt, "load_model", no_load)
    with pytest.raises(ConfigError, match="group size 128 does not divide q_proj"):
        Engine.from_model("tiny-gqa", EngineConfig(quantization="int4", group_size=128, device="cpu"))
    with pytest.raises(ConfigError, match="one of 32, 64, 128, 256"):
        Engine.from_model("tiny-mqa", EngineConfig(quantization="int4", group_size=48, device="cpu"))


def test_engine_refuses_a_model_quantized_otherwise():
    from workbench.model.checkpoint import load_model

    model = load_model("tiny-gqa")
    with pytest.raises(ConfigError, match="quantize_model"):
        Engine(model, EngineConfig(quantization="int8", device="cpu"))
