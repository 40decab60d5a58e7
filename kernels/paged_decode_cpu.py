"""Paged decode attention on the CPU, as a small C++ op: one query token per sequence read against its blocks.

Why our own op: the torch decode path (``TorchAttentionBackend.decode``) gathers every row's K/V out of the pool,
concatenates the new key and runs a masked SDPA, several full copies of the KV per layer per step; the maintained
routes do not avoid that on the CPU today (argued from how they lower in torch 2.13, not benchmarked against this
op): ``flex_attention`` lowers on the CPU through inductor's C++ template only for dense (B, H, S, D) K/V, so a
paged pool needs a gathered copy (a block mask only skips blocks of a dense tensor), and a compiled split-K over
the block tables compiles to the same gather (indexing the pool by slot) before its reduction. vLLM's CPU backend
has such a kernel (``csrc/cpu``), as a C++ op of its own; this file is ours, written from the algorithm
(flash-decoding's online softmax, Dao et al. 2023), not from that code.

The op (``kernels/csrc/paged_decode_cpu.cpp``): one task per sequence (or per (sequence, KV head) when the batch is
smaller than four per thread), the group's query heads sharing each K/V row (GQA/MQA without expanding K/V), the context
walked block table by block table in tiles of 32 tokens, every row read in place 8 values at a time and converted in
registers (bf16 widened by a shift, int8 and fp8 e4m3 to fp32, never a dequantized copy), each converted row scored
against up to 3 query heads of its group at once (fp32 rows one head at a time, 8 rows at once, or grouped too), the
next tile's rows prefetched while one is scored (a line a slot, or spread evenly: the two ``SCHEDULES``,
``decode_schedule`` picks the one measured faster on the CPU's vendor), the quantized rows' scales (int8: per token and
head; fp8: one) applied to the dot products and folded into the softmax weights rather than to the rows, an online
softmax in fp32 with a vectorized exp. The new token's K/V can be passed as the last key (``k_new``/``v_new``,
``cached_lens`` then counts the keys before it), which lets a compiled decode step attend before the step's one write
(``KVCache.write``) instead of writing a view of a graph input inside the graph.

The same library holds a second entry, ``prompt_attention`` (``prompt_attention_cpu``): the causal attention of whole
prompts over their own K/V, the step's rows as the model computed them, every prompt and KV head of a ragged step in
one call. Why not torch's SDPA, which the torch backend calls once per prompt: its CPU flash kernel ran the offline
set's prompts of 21-251 tokens at 55-83 GFLOP/s on the project's 2-core Xeon (torch 2.13, AVX-512, bench-300m's 16
query heads over 4 KV heads, head 64), a third of what a large product reaches there, and one call per prompt and
layer. The op takes blocks of query positions of one KV head (about 32 query rows: positions x the group's heads)
against tiles of K transposed once per call (32 keys on AVX-512: two 16-lane vectors of scores a row; 8 keys on AVX2
and the baseline), 8 rows register-blocked; an online softmax, then ``p V`` with V read in place; tasks handed out
dearest first. PyTorch's causal SDPA is its reference in the tests, on every ISA path. The CPU backend calls it where it
measured faster than SDPA (``workbench.model.cpu_backend.prompt_op_isas``): on the Xeon its AVX-512 path (1.1-1.6x a
call; 23-26% less attention time on the offline set) but not its AVX2 path (0.7-0.9x); on an AMD EPYC, where SDPA is
several times slower, both.

Built on first use with the machine's g++ (``torch.utils.cpp_extension.load``, cached under ``TORCH_EXTENSIONS_DIR``,
one directory per version of the source: ``CppOp``) and registered as ``torch.ops.workbench_cpu.paged_decode`` with a
fake kernel, so ``torch.compile`` keeps it as one opaque call. The C++ body is compiled three times (AVX-512,
AVX2+FMA+F16C, baseline x86-64, GCC target attributes); ``isa`` picks one per call, by default the best that both the
CPU and torch's dispatch (``torch.backends.cpu.get_cpu_capability()``) support, so an AVX-512 path is never chosen on an
AVX2 machine. ``available()`` is False when no compiler is present (or the build fails); callers then use the
plain-PyTorch path (the torch backend; ``workbench.kernels.reference`` is the fp32 reference the tests compare with).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

ISAS = {"default": 0, "avx2": 1, "avx512": 2}
# how the decode op paces its prefetches and groups fp32 rows' heads (the C++ file's NextTile and head_block): each
# the faster on the CPU it was measured on
SCHEDULES = {"line-a-slot": 0, "even": 1}
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3}
_SOURCE = Path(__file__).with_name("csrc") / "paged_decode_cpu.cpp"


class CpuKernelError(ValueError):
    """Inputs the CPU decode op cannot take, or an ISA this CPU lacks (the message says which and what fits)."""


class CppOp:
    """A C++ op (``torch.utils.cpp_extension``) compiled on first use, its build cached on disk across processes, and
    loaded once per process; ``register_fakes`` then registers its fake kernels (for ``torch.compile``). A failed
    build (no compiler, no headers) is remembered with its reason, and the caller falls back to plain PyTorch.

    The build lives in a directory named by a hash of what the library depends on (``build_key``: the source text,
    the headers of ``csrc/``, the flags, torch's version, the Python ABI) under torch's extension root
    (``TORCH_EXTENSIONS_DIR``), and a process that finds the library built there loads it without calling the build
    at all. Torch's own cache keys the build by the op's name only, so two checkouts (or versions) of the source took
    turns rebuilding one directory, a minute of g++ each time, and even an unchanged one re-ran ninja; here each
    version keeps its build."""

    def __init__(
        self, name: str, source: Path, cflags: list[str], register_fakes: Callable[[], None], library: str
    ) -> None:
        self.name, self.source, self.cflags, self.register_fakes = name, source, cflags, register_fakes
        self.library = library  # the torch.ops namespace the source registers, with its ``cpu_supports`` probe
        self._lock = threading.Lock()
        self._error: str | None = None
        self._built = False
        self.loaded_from_cache: bool | None = None  # after the first use: whether the library was already built

    def build_key(self) -> str:
        """16 hex digits of a hash of the source text, the headers beside it (``csrc/*.h``), the flags, torch's version
        and the Python ABI."""
        digest = hashlib.sha256()
        headers = [h.read_bytes() for h in sorted(self.source.parent.glob("*.h"))]
        for part in (self.source.read_bytes(), *headers, " ".join(self.cflags).encode(), torch.__version__.encode(),
                     sys.implementation.cache_tag.encode()):  # fmt: skip
            digest.update(part + b"\0")
        return digest.hexdigest()[:16]

    def build_dir(self) -> Path:
        """Where this version of the op is built: ``<torch's extension root>/<name>-<build_key>``."""
        from torch.utils.cpp_extension import get_default_build_root

        return Path(get_default_build_root()) / f"{self.name}-{self.build_key()}"

    def _build(self) -> None:
        with self._lock:
            if self._built:
                return
            try:
                build_dir = self.build_dir()
                library = build_dir / f"{self.name}.so"
                # built before (and no build under way: torch's lock file is gone): load it as it is
                self.loaded_from_cache = library.exists() and not (build_dir / "lock").exists()
                if self.loaded_from_cache:
                    torch.ops.load_library(str(library))
                else:
                    from torch.utils.cpp_extension import load

                    build_dir.mkdir(parents=True, exist_ok=True)
                    load(
                        name=self.name,
                        sources=[str(self.source)],
                        extra_cflags=[*self.cflags, "-fopenmp"],
                        extra_ldflags=["-fopenmp"],
                        build_directory=str(build_dir),
                        is_python_module=False,
                        verbose=os.environ.get("WORKBENCH_VERBOSE_BUILD") == "1",
                    )
                self.register_fakes()
            except Exception as exc:  # no compiler, no headers: the caller falls back
                self._error = f"{type(exc).__name__}: {exc}"
            self._built = True

    def available(self) -> bool:
        """Whether the op could be built and loaded here (the first call builds it)."""
        self._build()
        return self._error is None

    def build_error(self) -> str | None:
        """Why the op is not available (None when it is)."""
        self._build()
        return self._error

    def supported_isas(self) -> list[str]:
        """The code paths this CPU can run, best last (``isa_paths`` over the op's own ``cpu_supports`` probe); none
        when the op did not build."""
        return isa_paths(getattr(torch.ops, self.library).cpu_supports) if self.available() else []

    def default_isa(self) -> str:
        """The best code path here (``WORKBENCH_CPU_ISA`` forces one of ``supported_isas()``)."""
        return pick_isa(self.supported_isas())

    def check_isa(self, isa: str, what: str) -> None:
        """CpuKernelError naming ``what`` (the op, for the message) unless the op built and ``isa`` is one of
        ``supported_isas()``."""
        if not self.available():
            raise CpuKernelError(f"the {what} could not be built ({self.build_error()})")
        if isa not in self.supported_isas():
            raise CpuKernelError(f"isa {isa!r} is not supported on this CPU; use one of {self.supported_isas()}")


def _register_fakes() -> None:
    @torch.library.register_fake("workbench_cpu::paged_decode")
    def _fake(
        q, k_cache, v_cache, block_tables, cached_lens, k_scale, v_scale, k_new, v_new, scale, kind, isa, schedule
    ):
        return torch.empty_like(q)

    @torch.library.register_fake("workbench_cpu::prompt_attention")
    def _fake_prompt(q, k, v, out, starts, lens, scale, isa):
        return None


_OP = CppOp(
    "workbench_paged_decode_cpu", _SOURCE, ["-O3", "-fopenmp-simd", "-fno-math-errno"], _register_fakes, "workbench_cpu"
)
available = _OP.available
build_error = _OP.build_error
supported_isas = _OP.supported_isas
default_isa = _OP.default_isa


def isa_paths(cpu_supports: Callable[[int], bool]) -> list[str]:
    """The code paths of a C++ op compiled per ISA (every op of ``kernels/csrc``: ``CppOp.supported_isas``) that
    this CPU can run, best last: always 'default', then 'avx2', 'avx512' where the CPU has them (``cpu_supports``, the
    op's own probe) and torch's own dispatch would use them too (``torch.backends.cpu.get_cpu_capability()``)."""
    cap = torch.backends.cpu.get_cpu_capability()  # 'DEFAULT', 'AVX2', 'AVX512', ...
    out = ["default"]
    if cap in ("AVX2", "AVX512") and cpu_supports(ISAS["avx2"]):
        out.append("avx2")
    if cap == "AVX512" and cpu_supports(ISAS["avx512"]):
        out.append("avx512")
    return out


def pick_isa(isas: list[str]) -> str:
    """The best of ``isas`` (``isa_paths``), or the one ``WORKBENCH_CPU_ISA`` forces."""
    forced = os.environ.get("WORKBENCH_CPU_ISA")
    if forced:
        if forced not in isas:
            raise CpuKernelError(f"WORKBENCH_CPU_ISA={forced!r} is not supported on this CPU; use one of {isas}")
        return forced
    return isas[-1]


def decode_schedule(vendor: str) -> str:
    """The decode op's schedule for a CPU of ``vendor`` (``workbench.hardware.cpu_vendor()``): on Intel a line of the
    next tile a slot and fp32 heads one at a time (measured on a Sapphire Rapids Xeon), elsewhere the lines spread
    evenly and fp32 heads grouped (measured on an AMD EPYC, Zen 4: 1.2-1.3x at batch 16-32, 1 thread)."""
    return "line-a-slot" if vendor == "GenuineIntel" else "even"


@functools.cache
def default_schedule() -> str:
    """This CPU's schedule (``decode_schedule`` of its vendor), read from /proc/cpuinfo once per process."""
    from workbench.hardware import cpu_vendor

    return decode_schedule(cpu_vendor())


def paged_decode_attention_cpu(
    q: torch.Tensor,  # (num_seqs, num_heads, head_dim) fp32 or bf16
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim) fp32, bf16, int8 or float8_e4m3fn
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    seq_lens: torch.Tensor,  # (num_seqs,) keys per sequence (with k_new: the cached keys before the new one)
    scale: float | None = None,
    k_scale: torch.Tensor | None = None,  # int8: (num_blocks, block_size, num_kv_heads) fp32; fp8: one element
    v_scale: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,  # (num_seqs, num_kv_heads, head_dim): the new token's K, attended last
    v_new: torch.Tensor | None = None,
    isa: str | None = None,
    schedule: str | None = None,
) -> torch.Tensor:  # (num_seqs, num_heads, head_dim), q's dtype
    """One query per sequence over its paged context (plus ``k_new``/``v_new`` when given), read in place.

    Same op as ``reference.paged_decode_attention_reference`` (and, with scales, the quantized reference);
    ``isa`` one of ``supported_isas()`` (default ``default_isa()``), ``schedule`` one of ``SCHEDULES`` (default
    ``default_schedule()``)."""
    isa = default_isa() if isa is None else isa
    _OP.check_isa(isa, "CPU decode op (use the torch backend)")
    schedule = default_schedule() if schedule is None else schedule
    if schedule not in SCHEDULES:
        raise CpuKernelError(f"schedule {schedule!r} is not one of {list(SCHEDULES)}")
    if q.device.type != "cpu" or k_cache.device.type != "cpu":
        raise CpuKernelError(f"the CPU decode op needs CPU tensors, got {q.device} and {k_cache.device}")
    if k_cache.dtype not in KINDS or k_cache.dtype != v_cache.dtype:
        raise CpuKernelError(f"caches must share one of {list(KINDS)}, got {k_cache.dtype}, {v_cache.dtype}")
    if q.dim() != 3 or k_cache.dim() != 4 or q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise CpuKernelError(
            f"need q (B, H, D) and caches (blocks, block_size, KVH, D) with H a multiple of KVH, got "
            f"{tuple(q.shape)} and {tuple(k_cache.shape)}"
        )
    if q.shape[1] // k_cache.shape[2] > 64:
        raise CpuKernelError(f"at most 64 query heads per KV head, got {q.shape[1] // k_cache.shape[2]}")
    quantized = k_cache.dtype in (torch.int8, torch.float8_e4m3fn)
    if quantized and (k_scale is None or v_scale is None):
        raise CpuKernelError("a quantized cache needs k_scale and v_scale (fp32)")
    if (k_new is None) != (v_new is None):
        raise CpuKernelError("give both k_new and v_new, or neither")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return paged_decode_cpu_op(
        q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, k_new, v_new, isa, schedule
    )


def paged_decode_cpu_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    isa: str,
    schedule: str,
) -> torch.Tensor:
    """The op itself, without the checks of ``paged_decode_attention_cpu`` (what a compiled step traces: the
    caller has checked its inputs once, e.g. ``CpuAttentionBackend``, and ``available()`` has built the op)."""
    quantized = k_cache.dtype in (torch.int8, torch.float8_e4m3fn)
    return torch.ops.workbench_cpu.paged_decode(
        q, k_cache, v_cache, block_tables.to(torch.int32).contiguous(), seq_lens,
        k_scale.float() if quantized else None, v_scale.float() if quantized else None,
        k_new, v_new, scale, KINDS[k_cache.dtype], ISAS[isa], SCHEDULES[schedule],
    )  # fmt: skip


def prompt_attention_cpu(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim) fp32, rotary applied
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim) fp32: the step's K as written (rows may be strided)
    v: torch.Tensor,
    starts: list[int],  # each prompt's first row
    lens: list[int],  # its length: the prompt is its sequence's whole context
    scale: float,
    out: torch.Tensor | None = None,  # (num_tokens, num_heads, head_dim) fp32; the prompts' rows are written
    isa: str | None = None,
) -> torch.Tensor:
    """Causal attention of each whole prompt ``q[s : s + n]`` over its own ``k``/``v`` rows (the op's second entry,
    ``prompt_attention`` in ``kernels/csrc/paged_decode_cpu.cpp``): what ``F.scaled_dot_product_attention`` with
    ``is_causal=True`` (and ``enable_gqa``) computes per prompt, all prompts and KV heads in one call. The other rows
    of ``out`` are left as they are. ``isa`` one of ``supported_isas()`` (default ``default_isa()``)."""
    isa = default_isa() if isa is None else isa
    _OP.check_isa(isa, "CPU attention op (use the torch backend)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 3:
            raise CpuKernelError(f"{name} must be a 3-D fp32 CPU tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1]:
        raise CpuKernelError(f"need q (T, H, D), k and v (T, KVH, D) with H a multiple of KVH, got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")  # fmt: skip
    if len(starts) != len(lens) or any(n < 1 or s < 0 or s + n > q.shape[0] for s, n in zip(starts, lens)):
        raise CpuKernelError(f"prompts (starts {starts}, lens {lens}) must be non-empty rows of q's {q.shape[0]}")
    out = torch.empty_like(q) if out is None else out
    prompt_attention_cpu_op(q, k, v, out, list(starts), list(lens), float(scale), isa)
    return out


def prompt_attention_cpu_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, starts: list[int], lens: list[int],
    scale: float, isa: str,
) -> None:  # fmt: skip
    """The prompt entry without the checks of ``prompt_attention_cpu`` (its caller has them: ``CpuAttentionBackend``),
    writing ``out``. K/V whose rows do not hold a token's heads side by side are copied into that layout first (the
    model's views of its QKV projection already have it)."""
    k, v = (t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous() for t in (k, v))
    torch.ops.workbench_cpu.prompt_attention(q, k, v, out, starts, lens, scale, ISAS[isa])
