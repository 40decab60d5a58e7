"""The CPU paged decode op (``kernels/paged_decode_cpu.py``) against the fp32 references, on a vLLM-style grid, on every
code path this CPU can run (the baseline, AVX2 and, on an AVX-512 machine, AVX-512); its prompt entry against PyTorch's
causal SDPA; the backend built on it against the torch backend, eagerly and compiled; and the engine's greedy tokens
with it against the torch backend's."""

import re
import shutil
import subprocess

import pytest
import torch
from workbench.kernels.paged_decode_cpu import (
    SCHEDULES,
    CpuKernelError,
    available,
    decode_schedule,
    default_isa,
    paged_decode_attention_cpu,
    prompt_attention_cpu,
    supported_isas,
)
from workbench.kernels.reference import paged_decode_attention_quantized_reference, paged_decode_attention_reference
from workbench.kernels.testing import TOLERANCES, random_block_tables, random_paged_batch, repage

from workbench.config import ModelConfig
from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.errors import ConfigError
from workbench.kv.cache import KVCache, quantize_kv_fp8, quantize_kv_int8
from workbench.model.attention import TorchAttentionBackend, build_decode_metadata, build_metadata
from workbench.model.transformer import Transformer
from workbench.request import SamplingParams

pytestmark = pytest.mark.skipif(not available(), reason="the CPU decode op needs a C++ compiler")

NUM_HEADS = [(4, 4), (8, 2), (8, 1)]  # MHA, GQA, MQA
HEAD_SIZES = [24, 64, 80]  # 24 and 80: not powers of two
BLOCK_SIZES = [1, 16, 32]
SEQ_LENS = [1, 17, 40, 75, 130]  # ending mid-block; 130 spans several 32-token tiles
ISAS = ["default", "avx2", "avx512"]


def need_isa(isa: str) -> None:
    if isa not in supported_isas():
        pytest.skip(f"this CPU has no {isa} path ({torch.backends.cpu.get_cpu_capability()})")


def batch_of(num_heads, head_size, block_size, dtype=torch.float32, seed=0, **kw):
    n_q, n_kv = num_heads
    return random_paged_batch([1] * len(SEQ_LENS), SEQ_LENS, n_q, n_kv, head_size, block_size, dtype, seed=seed, **kw)


def reference(batch):
    return paged_decode_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("num_heads", NUM_HEADS)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_matches_reference_fp32(isa, num_heads, head_size, block_size):
    need_isa(isa)
    batch = batch_of(num_heads, head_size, block_size)
    out = paged_decode_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                     isa=isa)  # fmt: skip
    torch.testing.assert_close(out, reference(batch), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("num_heads", NUM_HEADS)
def test_decode_matches_reference_bf16(isa, num_heads):
    need_isa(isa)
    batch = batch_of(num_heads, 80, 16, torch.bfloat16)
    out = paged_decode_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                     isa=isa)  # fmt: skip
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference(batch), **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("num_heads", NUM_HEADS)
@pytest.mark.parametrize("block_size", [1, 16])
def test_quantized_decode_matches_reference(isa, kv_dtype, num_heads, block_size):
    need_isa(isa)
    batch = batch_of(num_heads, 24, block_size)
    if kv_dtype == "int8":
        (kq, ks), (vq, vs) = quantize_kv_int8(batch.k_cache), quantize_kv_int8(batch.v_cache)
    else:
        ks, vs = torch.tensor([0.5]), torch.tensor([0.25])
        kq, vq = quantize_kv_fp8(batch.k_cache, ks), quantize_kv_fp8(batch.v_cache, vs)
    args = (batch.q, kq, vq, batch.block_tables, batch.seq_lens)
    out = paged_decode_attention_cpu(*args, k_scale=ks, v_scale=vs, isa=isa)
    ref = paged_decode_attention_quantized_reference(*args, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("isa", ISAS)
def test_every_fp8_code_decodes_exactly(isa):
    """Each of e4m3fn's 254 values (normals, subnormals, both zeros; not the NaNs 0x7f/0xff, never written) as V of a
    one-token context: the output is the value times the layer's scale (a power of two: exact), torch's own
    float8_e4m3fn -> fp32 conversion being the peer. Compared at fp32's tolerance: neighbouring e4m3 values lie at least
    1/16 apart relatively and the smallest subnormal here is 2^-10, so any code decoded wrong, or a subnormal lost,
    is far outside it."""
    need_isa(isa)
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    d = codes.numel()  # 254 = 31 chunks of 8 and a partial one
    v = codes.view(torch.float8_e4m3fn).view(1, 1, 1, d)
    k = torch.zeros(1, 1, 1, d, dtype=torch.float8_e4m3fn)
    q = torch.randn(1, 1, d)
    args = (q, k, v, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32))
    out = paged_decode_attention_cpu(*args, k_scale=torch.tensor([1.0]), v_scale=torch.tensor([0.5]), isa=isa)
    expected = codes.view(torch.float8_e4m3fn).float() * 0.5
    torch.testing.assert_close(out.view(-1), expected, **TOLERANCES[torch.float32])
    assert expected.abs().min() == 0 and 0 < expected.abs()[expected != 0].min() < 2**-6 * 0.5  # subnormals in it


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("num_heads", NUM_HEADS)
@pytest.mark.parametrize("head_size", [20, 64])  # 20: each row ends in a partial chunk of 8 values (read padded)
@pytest.mark.parametrize("threads", [1, 2])  # 1: a task per sequence (5 >= 4 per thread); 2: per (sequence, KV head)
@pytest.mark.parametrize("schedule", list(SCHEDULES))  # the prefetch pace and fp32 head groups of each CPU vendor
def test_decode_task_layouts_match_reference(isa, num_heads, head_size, threads, schedule):
    need_isa(isa)
    batch = batch_of(num_heads, head_size, 16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_decode_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                         isa=isa, schedule=schedule)  # fmt: skip
        kq, ks = quantize_kv_int8(batch.k_cache)
        vq, vs = quantize_kv_int8(batch.v_cache)
        args = (batch.q, kq, vq, batch.block_tables, batch.seq_lens)
        out_int8 = paged_decode_attention_cpu(*args, k_scale=ks, v_scale=vs, isa=isa, schedule=schedule)
        fs = (torch.tensor([0.01]), torch.tensor([0.02]))  # fp8 too: the rows' partial chunks through its conversion
        kf, vf = quantize_kv_fp8(batch.k_cache, fs[0]), quantize_kv_fp8(batch.v_cache, fs[1])
        fp8_args = (batch.q, kf, vf, batch.block_tables, batch.seq_lens)
        out_fp8 = paged_decode_attention_cpu(*fp8_args, k_scale=fs[0], v_scale=fs[1], isa=isa, schedule=schedule)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, reference(batch), **TOLERANCES[torch.float32])
    ref_int8 = paged_decode_attention_quantized_reference(*args, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out_int8, ref_int8, **TOLERANCES[torch.float32])
    ref_fp8 = paged_decode_attention_quantized_reference(*fp8_args, k_scale=fs[0], v_scale=fs[1])
    torch.testing.assert_close(out_fp8, ref_fp8, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("isa", ISAS)
def test_new_key_given_equals_new_key_written(isa):
    """k_new/v_new as the last key (the pool's last slot holding junk) equals the pool holding them."""
    need_isa(isa)
    batch = batch_of((8, 2), 24, 16)
    bs = batch.k_cache.shape[1]
    last = [(t[(n - 1) // bs], (n - 1) % bs) for t, n in zip(batch.block_tables_list, batch.seq_lens_list)]
    k_new = torch.stack([batch.k_cache[b, r] for b, r in last])  # (B, kv_heads, d)
    v_new = torch.stack([batch.v_cache[b, r] for b, r in last])
    k_junk, v_junk = batch.k_cache.clone(), batch.v_cache.clone()
    for b, r in last:
        k_junk[b, r], v_junk[b, r] = 1e3, -1e3
    out = paged_decode_attention_cpu(batch.q, k_junk, v_junk, batch.block_tables, batch.seq_lens - 1,
                                     k_new=k_new, v_new=v_new, isa=isa)  # fmt: skip
    torch.testing.assert_close(out, reference(batch), **TOLERANCES[torch.float32])


def test_block_size_1_equals_block_size_16():
    batch = batch_of((8, 2), 64, 16)
    other = repage(batch, 1)
    outs = [paged_decode_attention_cpu(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens) for b in (batch, other)]
    torch.testing.assert_close(outs[0], outs[1], **TOLERANCES[torch.float32])


def test_large_pool():
    """Sequences in the last blocks of a pool past 2**24 rows (offsets beyond what a float or a small int can index)."""
    block_size, n_kv, d = 16, 1, 64
    num_blocks = (1 << 24) // block_size + 64  # 2**24 token rows, 256 MiB per fp32 pool
    batch = random_paged_batch([1, 1], [40, 70], 4, n_kv, d, block_size)
    k_cache = torch.zeros((num_blocks, block_size, n_kv, d))
    v_cache = torch.zeros_like(k_cache)
    tables = [[num_blocks - 1 - 8 * s - i for i in range(len(t))] for s, t in enumerate(batch.block_tables_list)]
    for old, new in zip(batch.block_tables_list, tables):
        k_cache[new] = batch.k_cache[old]
        v_cache[new] = batch.v_cache[old]
    bt = torch.tensor([t + [0] * (5 - len(t)) for t in tables], dtype=torch.int32)
    out = paged_decode_attention_cpu(batch.q, k_cache, v_cache, bt, batch.seq_lens)
    torch.testing.assert_close(out, reference(batch), **TOLERANCES[torch.float32])


def test_isa_choice_follows_the_cpu(monkeypatch):
    cap = torch.backends.cpu.get_cpu_capability()
    isas = supported_isas()
    assert isas[0] == "default" and default_isa() == isas[-1]
    assert ("avx512" in isas) == (cap == "AVX512")  # never an AVX-512 path where torch itself does not use one
    if cap in ("AVX2", "AVX512"):
        assert "avx2" in isas
        monkeypatch.setenv("WORKBENCH_CPU_ISA", "avx2")  # what forces the AVX2 path on an AVX-512 machine
        assert default_isa() == "avx2"
    batch = batch_of((4, 4), 24, 16)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    for isa in set(ISAS) - set(isas):
        monkeypatch.setenv("WORKBENCH_CPU_ISA", isa)
        with pytest.raises(CpuKernelError, match="not supported on this CPU"):
            default_isa()
        with pytest.raises(CpuKernelError, match="not supported on this CPU"):
            paged_decode_attention_cpu(*args, isa=isa)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump")
def test_avx512_path_is_compiled():
    """The AVX-512 body is in the library even where it cannot run (it uses zmm registers, the AVX2 one ymm)."""
    lib = next(p for p in torch.ops.loaded_libraries if "workbench_paged_decode_cpu" in p)
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", lib], capture_output=True, text=True).stdout

    def body(name: str) -> str:  # the function's own listing: from its label to the next blank line
        match = re.search(rf"^[0-9a-f]+ <\(anonymous namespace\)::{name}\(.*?\)>:\n(.*?)\n\n", asm, re.M | re.S)
        assert match, name
        return match.group(1)

    assert "zmm" in body("task_avx512")
    assert "ymm" in body("task_avx2") and "zmm" not in body("task_avx2")
    assert "ymm" not in body("task_default")


def test_rejects_bad_inputs():
    batch = batch_of((8, 2), 24, 16)
    with pytest.raises(CpuKernelError, match="multiple of KVH"):
        paged_decode_attention_cpu(batch.q[:, :7], batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    kq, ks = quantize_kv_int8(batch.k_cache)
    with pytest.raises(CpuKernelError, match="k_scale and v_scale"):
        paged_decode_attention_cpu(batch.q, kq, kq, batch.block_tables, batch.seq_lens)
    with pytest.raises(CpuKernelError, match="both k_new and v_new"):
        paged_decode_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                   k_new=batch.k_cache[0, :5])  # fmt: skip
    with pytest.raises(CpuKernelError, match="schedule 'fast' is not one of"):
        paged_decode_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                   schedule="fast")  # fmt: skip
    from workbench.model.cpu_backend import CpuAttentionBackend

    with pytest.raises(ConfigError, match="schedule 'fast' is not one of"):
        CpuAttentionBackend(schedule="fast")
    with pytest.raises(RuntimeError, match="schedule 5 is not 0 or 1"):  # the op itself, past the Python checks
        torch.ops.workbench_cpu.paged_decode(batch.q, batch.k_cache, batch.v_cache, batch.block_tables.int(),
                                             batch.seq_lens, None, None, None, None, 0.25, 0, 0, 5)  # fmt: skip


def test_decode_schedule_per_vendor():
    assert decode_schedule("GenuineIntel") == "line-a-slot"
    assert decode_schedule("AuthenticAMD") == "even"
    assert decode_schedule("") == "even"  # a CPU that does not say


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("preset", ["tiny-mha", "tiny-gqa", "tiny-mqa"])
@pytest.mark.parametrize("compiled", [False, True])
def test_backend_decode_matches_torch_backend(preset, kv_dtype, compiled):
    from workbench.model.cpu_backend import CpuAttentionBackend

    if compiled and preset != "tiny-gqa":
        pytest.skip("one compiled preset is enough")
    cfg = ModelConfig.from_name(preset)
    seq_lens, bs = [1, 9, 16, 33, 20], 16
    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-s // bs) for s in seq_lens) + 2
    tables = random_block_tables(seq_lens, bs, num_blocks, gen)
    meta = build_decode_metadata(seq_lens, tables, bs)
    cache = KVCache(cfg, num_blocks, bs, kv_cache_dtype=kv_dtype)
    n_tok = num_blocks * bs
    shape = (cfg.num_layers, n_tok, cfg.num_kv_heads, cfg.head_dim)
    cache.write(torch.arange(n_tok), torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    b, n_kv, d = len(seq_lens), cfg.num_kv_heads, cfg.head_dim
    q = torch.randn(b, cfg.num_heads, d, generator=gen)
    k, v = torch.randn(b, n_kv, d, generator=gen), torch.randn(b, n_kv, d, generator=gen)
    cpu = CpuAttentionBackend()
    fn = torch.compile(cpu.decode, fullgraph=True) if compiled else cpu.decode
    out = fn(1, q, k, v, cache, meta, 0.2)
    ref = TorchAttentionBackend().decode(1, q, k, v, cache, meta, 0.2)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


def _ragged_step(preset: str, query_lens: list[int], seq_lens: list[int], seed: int):
    """(q, k_cache, v_cache, meta) of a ragged step of ``preset``'s shape: random queries and a random fp32 pool in
    16-token blocks, each sequence's blocks scattered over it."""
    cfg, bs = ModelConfig.from_name(preset), 16
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // bs) for s in seq_lens) + 2
    meta = build_metadata(query_lens, seq_lens, random_block_tables(seq_lens, bs, num_blocks, gen), bs)
    shape = (num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    return torch.randn(sum(query_lens), cfg.num_heads, cfg.head_dim, generator=gen), k_cache, v_cache, meta


@pytest.mark.parametrize("preset", ["tiny-mha", "tiny-gqa", "tiny-mqa"])
def test_short_chunk_forward_matches_torch_backend(preset):
    # a ragged step of short chunks (speculative verifies of k + 1 = 5 tokens, a decode, a 3-token first chunk):
    # the cpu backend attends one decode-op row per token over the written pool; the torch backend's SDPA is the peer
    from workbench.model.cpu_backend import PAGED_MAX_QUERY_LEN, CpuAttentionBackend

    query_lens = [5, 1, 3, 5]
    assert max(query_lens) <= PAGED_MAX_QUERY_LEN
    q, k_cache, v_cache, meta = _ragged_step(preset, query_lens, [21, 9, 3, 40], seed=1)
    out = CpuAttentionBackend().forward(q, k_cache, v_cache, meta, 0.2)
    ref = TorchAttentionBackend().forward(q, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("preset", ["tiny-mha", "tiny-gqa", "tiny-mqa"])
def test_mixed_step_forward_matches_torch_backend(preset):
    # a chunked-prefill step: a 40-token chunk (SDPA), decodes and a 5-token chunk beside it (the decode op, one call),
    # and a 17-token chunk (just over the op's limit: SDPA); the torch backend's SDPA over the whole step is the peer
    from workbench.model.cpu_backend import PAGED_MAX_QUERY_LEN, CpuAttentionBackend

    query_lens, seq_lens = [1, 40, 1, 5, PAGED_MAX_QUERY_LEN + 1, 1], [30, 57, 2, 21, 33, 16]
    q, k_cache, v_cache, meta = _ragged_step(preset, query_lens, seq_lens, seed=2)
    short, tables, num_keys, long = meta.split_chunks(PAGED_MAX_QUERY_LEN)
    assert long == [1, 4] and short.tolist() == [0, 41, 42, 43, 44, 45, 46, 64]
    all_tables, all_keys = meta.token_rows()  # every token as a decode row: the short ones' must be these
    assert torch.equal(tables, all_tables[short]) and torch.equal(num_keys, all_keys[short])
    out = CpuAttentionBackend().forward(q, k_cache, v_cache, meta, 0.2)
    ref = TorchAttentionBackend().forward(q, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])
    # the torch backend's subset: only the long chunks' rows are written
    part = TorchAttentionBackend().forward(q, k_cache, v_cache, meta, 0.2, seqs=long, out=torch.zeros_like(ref))
    rows = torch.zeros(len(q), dtype=torch.bool)
    rows[1:41], rows[47:64] = True, True
    torch.testing.assert_close(part[rows], ref[rows], **TOLERANCES[torch.float32])
    assert not part[~rows].any()


@pytest.mark.parametrize(
    ("compile_decode", "policy"), [(False, "continuous"), (True, "continuous"), (False, "chunked")]
)
def test_engine_greedy_tokens_identical(compile_decode, policy):
    # chunked: 24-token steps, so the prompts' chunks run beside the other requests' decodes (mixed steps)
    prompts = [list(range(3, 40)), list(range(100, 140)), [5, 6, 7]]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    budget = {"token_budget": 24} if policy == "chunked" else {}
    results = {}
    for backend in ("torch", "cpu"):
        cfg = EngineConfig(block_size=16, num_blocks=32, max_num_seqs=4, attention_backend=backend, dtype="fp32",
                           device="cpu", compile_decode=compile_decode, policy=policy, **budget)  # fmt: skip
        engine = Engine(Transformer.from_config(ModelConfig.from_name("tiny-gqa"), device="cpu", seed=0), cfg)
        assert engine.backend.name == backend
        mixed: list[bool] = []  # per step: a chunk over the op's limit with decodes beside it
        engine.on_step = lambda plan, rec, mixed=mixed: mixed.append(
            rec.num_prefill_tokens > 16 and rec.num_decode_tokens > 0
        )
        results[backend] = [r.tokens for r in engine.generate(prompts, params).requests]
        assert any(mixed) == (policy == "chunked")
    assert results["cpu"] == results["torch"]
    assert all(len(t) == 20 for t in results["torch"])


def test_auto_is_cpu_on_the_cpu():
    engine = Engine(Transformer.from_config(ModelConfig.from_name("tiny-gqa"), device="cpu", seed=0),
                    EngineConfig(block_size=16, num_blocks=8, max_num_seqs=2, dtype="fp32", device="cpu"))  # fmt: skip
    assert engine.backend.name == "cpu"


def test_a_built_op_is_loaded_from_its_versions_directory_without_building(tmp_path, monkeypatch):
    """The build lives in a directory named by the source's version: a later process (here a fresh ``CppOp`` of the
    same source) loads the library found there and never calls the build; another version of the source gets a
    directory of its own, so two checkouts no longer take turns rebuilding one (a minute of g++ each)."""
    import torch.utils.cpp_extension as cpp_extension

    from workbench.kernels import paged_decode_cpu as module

    op = module._OP
    assert (op.build_dir() / f"{op.name}.so").exists()  # available() built it there
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("a built op was built again"))
    again = module.CppOp(op.name, op.source, op.cflags, lambda: None, op.library)
    assert again.available() and again.loaded_from_cache is True
    changed = tmp_path / op.source.name
    changed.write_text(op.source.read_text() + "\n// another version\n")
    other = module.CppOp(op.name, changed, op.cflags, lambda: None, op.library)
    assert other.build_dir().parent == op.build_dir().parent and other.build_dir() != op.build_dir()
    assert module.CppOp(op.name, op.source, [*op.cflags, "-g"], lambda: None, op.library).build_dir() != op.build_dir()
    # the headers beside the source (kernels/csrc/*.h) are part of its version too
    copy = tmp_path / "csrc"
    copy.mkdir()
    for path in (op.source, *op.source.parent.glob("*.h")):
        (copy / path.name).write_bytes(path.read_bytes())
    same = module.CppOp(op.name, copy / op.source.name, op.cflags, lambda: None, op.library)
    assert same.build_dir() == op.build_dir()
    (copy / "cpu_isa.h").write_text((copy / "cpu_isa.h").read_text() + "\n// another version\n")
    assert same.build_dir() != op.build_dir()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads, kv_heads", NUM_HEADS)
@pytest.mark.parametrize("head_size", [16, 24, 64, 80, 128])
def test_prompt_attention_matches_causal_sdpa(isa, heads, kv_heads, head_size):
    # whole prompts over their own K/V: PyTorch's causal SDPA per prompt (enable_gqa) is the peer. Lengths around the
    # op's 16-key tiles and its query blocks (32 rows: 32 / group positions), K/V strided rows of one QKV tensor as the
    # model passes them, the prompts after 3 rows that stay as they were
    need_isa(isa)
    gen = torch.Generator().manual_seed(heads * 1000 + kv_heads * 100 + head_size)
    lens = [1, 15, 16, 17, 33, 70]
    starts = [3 + sum(lens[:i]) for i in range(len(lens))]
    t = 3 + sum(lens)
    qkv = torch.randn(t, heads + 2 * kv_heads, head_size, generator=gen)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    scale = head_size**-0.5
    ref = torch.full((t, heads, head_size), 7.0)
    for s, n in zip(starts, lens):
        rows = slice(s, s + n)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=True,
        )  # fmt: skip
        ref[rows] = o[0].transpose(0, 1)
    out = prompt_attention_cpu(q, k, v, starts, lens, scale, out=torch.full((t, heads, head_size), 7.0), isa=isa)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


def test_prompt_attention_rejects_bad_input():
    q, kv = torch.randn(10, 4, 16), torch.randn(10, 2, 16)
    with pytest.raises(CpuKernelError, match="non-empty rows"):
        prompt_attention_cpu(q, kv, kv, [0, 8], [4, 5], 0.25)
    with pytest.raises(CpuKernelError, match="fp32"):
        prompt_attention_cpu(q.bfloat16(), kv, kv, [0], [4], 0.25)
    with pytest.raises(CpuKernelError, match="multiple of KVH"):
        prompt_attention_cpu(torch.randn(10, 3, 16), kv, kv, [0], [4], 0.25)


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("preset", ["tiny-mha", "tiny-gqa", "tiny-mqa"])
def test_mixed_step_with_prompts_matches_torch_backend(preset, isa):
    # a chunked-prefill step as the model hands it over, its K/V written into the pool and given: two whole prompts
    # (the prompt entry, one call), a chunk over a cached prefix (SDPA), decodes and a short chunk (the decode op);
    # the torch backend reading everything from the pool is the peer
    from workbench.kernels.reference import kv_write_reference

    from workbench.model.cpu_backend import CpuAttentionBackend

    cfg = ModelConfig.from_name(preset)
    query_lens, seq_lens = [1, 40, 30, 5, 1, 21], [30, 40, 57, 21, 16, 21]
    q, k_cache, v_cache, meta = _ragged_step(preset, query_lens, seq_lens, seed=3)
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(len(q), cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim, generator=gen)
    k, v = qkv[:, cfg.num_heads : cfg.num_heads + cfg.num_kv_heads], qkv[:, cfg.num_heads + cfg.num_kv_heads :]
    kv_write_reference(k, v, k_cache, v_cache, meta.slot_mapping)
    backend = CpuAttentionBackend(isa)  # prompts through the prompt entry on the paths of prompt_op_isas, else SDPA
    out = backend.forward(q, k_cache, v_cache, meta, 0.2, k, v)
    ref = TorchAttentionBackend().forward(q, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])
    # the prompts' rows come from the step's K/V as given (not read back from the pool): other K/V change them only
    moved = backend.forward(q, k_cache, v_cache, meta, 0.2, k + 1.0, v)
    prompt_rows = torch.zeros(len(q), dtype=torch.bool)
    prompt_rows[1:41], prompt_rows[77:98] = True, True
    assert not torch.allclose(moved[prompt_rows], out[prompt_rows])
    assert torch.equal(moved[~prompt_rows], out[~prompt_rows])


def test_prompts_take_the_op_on_avx2_off_intel_only():
    from workbench.model.cpu_backend import prompt_op_isas

    assert prompt_op_isas("GenuineIntel") == ("avx512",)
    assert prompt_op_isas("AuthenticAMD") == prompt_op_isas("") == ("avx512", "avx2")
