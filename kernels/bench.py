"""Benchmark of the paged attention kernels on a CUDA GPU: achieved bandwidth for decode, TFLOP/s for prefill.

    python -m workbench.kernels.bench [--out FILE] [--quick] [--dtype bf16|fp16] [--block-size 16]

Decode is memory-bound: its figure of merit is the K/V bytes it reads per second, set against the device's
copy bandwidth measured in the same run (``dst.copy_(src)`` on a large buffer: read + write bytes / time) and
against PyTorch doing the same job (the torch backend's gather of the paged K/V followed by SDPA, and SDPA on
an already contiguous cache, which needs no gather). Prefill is compute-bound: TFLOP/s of the causal attention
(``4 * head_dim * num_heads`` per visible query-key pair) against SDPA's flash backend on contiguous tensors.
Medians of ``triton.testing.do_bench``; the targets (decode at batch 64, KV 4096, 32/8 heads, head 128 reaching
80% of copy bandwidth; prefill at 4k tokens reaching 0.8x SDPA-flash) are reported, never asserted.
Needs only torch and triton (no workbench import), so it runs on a bare GPU box with the repository on
``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from workbench.parsing import make_parser
from workbench.roofline import attended_pairs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HEAD_DIM = 128
# decode grid: batch x KV length x (query heads, KV heads)
DECODE_BATCHES = [1, 16, 64]
DECODE_KV_LENS = [1024, 4096, 16384]
DECODE_HEADS = [(32, 8), (32, 32), (32, 1)]
QUICK_DECODE = [(1, 4096, (32, 8)), (64, 1024, (32, 8)), (64, 4096, (32, 32))]
# prefill rows: (num_seqs, query tokens per sequence, cached tokens before them)
PREFILL_ROWS = [(1, 1024, 0), (4, 1024, 0), (1, 4096, 0), (1, 8192, 0), (1, 1024, 3072)]
QUICK_PREFILL = [(4, 1024, 0), (1, 1024, 3072)]
PREFILL_HEADS = (32, 8)
DECODE_TARGET = {"batch": 64, "kv_len": 4096, "num_heads": 32, "num_kv_heads": 8, "min_copy_fraction": 0.8}
PREFILL_TARGET = {"num_seqs": 1, "query_len": 4096, "ctx_len": 0, "min_ratio_to_flash": 0.8}
SPLIT_SWEEP = [1, 2, 4, 8, 16]


# ---- what each op costs -----------------------------------------------------------------------------------
def decode_bytes(batch: int, kv_len: int, num_heads: int, num_kv_heads: int, head_dim: int, elt: int) -> int:
    """Bytes a decode step must move: all K and V of every sequence, plus the queries read and outputs written."""
    kv = 2 * batch * kv_len * num_kv_heads * head_dim * elt
    return kv + 2 * batch * num_heads * head_dim * elt


def prefill_flops(num_seqs: int, query_len: int, ctx_len: int, num_heads: int, head_dim: int) -> int:
    """2 FLOPs per multiply-add, two matmuls (QK^T and PV) per visible pair and head."""
    return 4 * head_dim * num_heads * num_seqs * attended_pairs(query_len, ctx_len)


# ---- the PyTorch peers --------------------------------------------------------------------------------------
def torch_paged_decode(
    q: torch.Tensor,  # (B, heads, d)
    k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, d)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, nb) int32
    seq_len: int,  # every sequence's length (the bench's batches are uniform)
    scale: float,
) -> torch.Tensor:
    """What the torch backend does for a decode batch: gather each sequence's blocks, then SDPA."""
    b, n_kv, d = q.shape[0], k_cache.shape[2], k_cache.shape[3]
    ids = block_tables.long()
    k = k_cache[ids].view(b, -1, n_kv, d)[:, :seq_len].transpose(1, 2)  # (B, kv_heads, S, d)
    v = v_cache[ids].view(b, -1, n_kv, d)[:, :seq_len].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=q.shape[1] != n_kv)
    return out.squeeze(2)  # (B, heads, d)


def sdpa_dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA of q (B, heads, d) over a contiguous cache k, v (B, kv_heads, S, d): no paging, no gather."""
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(2)


def flash_prefill_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int) -> Callable[[], Any] | None:
    """SDPA restricted to the flash backend on (B, heads, N, d) tensors, causal (bottom-right when ctx_len > 0).

    GQA through ``enable_gqa`` when the build supports it with flash, else K/V expanded to all heads beforehand
    (prefill is compute-bound: the expansion's extra reads barely matter). None when flash cannot run it.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    candidates: list[tuple[torch.Tensor, torch.Tensor, bool]] = [(k, v, True)] if group > 1 else []
    candidates.append((k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), False))
    for kk, vv, gqa in candidates:
        if ctx_len == 0:
            kwargs: dict[str, Any] = {"is_causal": True}
        else:
            from torch.nn.attention.bias import causal_lower_right

            kwargs = {"attn_mask": causal_lower_right(q.shape[2], kk.shape[2])}
        if gqa:
            kwargs["enable_gqa"] = True

        def fn(kk: torch.Tensor = kk, vv: torch.Tensor = vv, kwargs: dict[str, Any] = kwargs) -> torch.Tensor:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, kk, vv, **kwargs)

        try:
            fn()
            if q.is_cuda:
                torch.cuda.synchronize()
            return fn
        except (RuntimeError, TypeError, ValueError):
            continue
    return None


# ---- measurements ---------------------------------------------------------------------------------------------
def bench_ms(fn: Callable[[], Any], rep_ms: int) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=max(rep_ms // 4, 10), rep=rep_ms, return_mode="median"))


def measure_copy_bandwidth(device: torch.device, rep_ms: int, nbytes: int = 2 * 1024**3) -> float:
    """Device copy bandwidth in GB/s: a ``nbytes`` buffer copied to another (counts the read and the write)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), rep_ms)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def paged_pool(
    num_seqs: int, seq_len: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random pool holding ``num_seqs`` sequences of ``seq_len`` tokens in randomly permuted blocks."""
    nb = math.ceil(seq_len / block_size)
    num_blocks = num_seqs * nb + 8
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    tables = torch.randperm(num_blocks, device=device)[: num_seqs * nb].view(num_seqs, nb).to(torch.int32)
    return k_cache, v_cache, tables.contiguous()


def bench_decode_row(
    batch: int,
    kv_len: int,
    heads: tuple[int, int],
    dtype: torch.dtype,
    block_size: int,
    copy_gbps: float,
    rep_ms: int,
    device: torch.device | str = "cuda",
    head_dim: int = HEAD_DIM,
) -> dict[str, Any]:
    """One decode row: every sequence ``kv_len`` tokens long; Triton vs the torch backend and dense SDPA."""
    from workbench.kernels.paged_decode import default_num_splits, paged_decode_attention

    device = torch.device(device)
    n_q, n_kv = heads
    k_cache, v_cache, tables = paged_pool(batch, kv_len, n_kv, head_dim, block_size, dtype, device)
    q = torch.randn(batch, n_q, head_dim, dtype=dtype, device=device)
    seq_lens = torch.full((batch,), kv_len, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    nbytes = decode_bytes(batch, kv_len, n_q, n_kv, head_dim, k_cache.element_size())
    splits = default_num_splits(batch, n_kv, kv_len, device)

    def triton_fn(num_splits: int | None = None) -> torch.Tensor:
        return paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, num_splits, max_seq_len=kv_len)

    out = triton_fn()
    ref = torch_paged_decode(q, k_cache, v_cache, tables, kv_len, scale)
    max_err = (out.float() - ref.float()).abs().max().item()
    t_triton = bench_ms(triton_fn, rep_ms)
    t_torch = bench_ms(lambda: torch_paged_decode(q, k_cache, v_cache, tables, kv_len, scale), rep_ms)
    ids = tables.long()
    k_dense = k_cache[ids].view(batch, -1, n_kv, head_dim)[:, :kv_len].transpose(1, 2).contiguous()
    v_dense = v_cache[ids].view(batch, -1, n_kv, head_dim)[:, :kv_len].transpose(1, 2).contiguous()
    t_dense = bench_ms(lambda: sdpa_dense_decode(q, k_dense, v_dense, scale), rep_ms)
    gbps = nbytes / (t_triton * 1e-3) / 1e9
    row: dict[str, Any] = {
        "batch": batch,
        "kv_len": kv_len,
        "num_heads": n_q,
        "num_kv_heads": n_kv,
        "head_dim": head_dim,
        "block_size": block_size,
        "num_splits": splits,
        "bytes": nbytes,
        "triton_ms": t_triton,
        "triton_gbps": gbps,
        "copy_fraction": gbps / copy_gbps,
        "torch_backend_ms": t_torch,
        "torch_backend_gbps": nbytes / (t_torch * 1e-3) / 1e9,
        "sdpa_dense_ms": t_dense,
        "sdpa_dense_gbps": nbytes / (t_dense * 1e-3) / 1e9,
        "speedup_vs_torch_backend": t_torch / t_triton,
        "speedup_vs_sdpa_dense": t_dense / t_triton,
        "max_abs_err_vs_torch": max_err,
    }
    is_target = (batch, kv_len, n_q, n_kv) == (
        DECODE_TARGET["batch"],
        DECODE_TARGET["kv_len"],
        DECODE_TARGET["num_heads"],
        DECODE_TARGET["num_kv_heads"],
    )
    if is_target:  # how the split count moves the target row
        row["split_sweep"] = {
            str(s): nbytes / (bench_ms(lambda s=s: triton_fn(s), rep_ms) * 1e-3) / 1e9 for s in SPLIT_SWEEP
        }
    return row


def bench_prefill_row(
    num_seqs: int,
    query_len: int,
    ctx_len: int,
    dtype: torch.dtype,
    block_size: int,
    rep_ms: int,
    device: torch.device | str = "cuda",
    head_dim: int = HEAD_DIM,
    heads: tuple[int, int] = PREFILL_HEADS,
) -> dict[str, Any]:
    """One prefill row: ``num_seqs`` chunks of ``query_len`` after ``ctx_len`` cached tokens; vs SDPA flash."""
    from workbench.kernels.paged_prefill import paged_prefill_attention

    device = torch.device(device)
    n_q, n_kv = heads
    seq_len = ctx_len + query_len
    k_cache, v_cache, tables = paged_pool(num_seqs, seq_len, n_kv, head_dim, block_size, dtype, device)
    q = torch.randn(num_seqs * query_len, n_q, head_dim, dtype=dtype, device=device)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)
    cu = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=device) * query_len
    scale = head_dim**-0.5
    flops = prefill_flops(num_seqs, query_len, ctx_len, n_q, head_dim)

    def triton_fn() -> torch.Tensor:
        return paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, cu, query_len, scale)

    out = triton_fn()
    t_triton = bench_ms(triton_fn, rep_ms)
    # the same problem as contiguous (B, heads, N, d) tensors for SDPA
    ids = tables.long()
    k = k_cache[ids].view(num_seqs, -1, n_kv, head_dim)[:, :seq_len].transpose(1, 2)  # (B, kv_heads, S, d)
    v = v_cache[ids].view(num_seqs, -1, n_kv, head_dim)[:, :seq_len].transpose(1, 2)
    qb = q.view(num_seqs, query_len, n_q, head_dim).transpose(1, 2)  # (B, heads, N, d)
    flash = flash_prefill_fn(qb, k, v, ctx_len)
    row: dict[str, Any] = {
        "num_seqs": num_seqs,
        "query_len": query_len,
        "ctx_len": ctx_len,
        "num_heads": n_q,
        "num_kv_heads": n_kv,
        "head_dim": head_dim,
        "block_size": block_size,
        "flops": flops,
        "triton_ms": t_triton,
        "triton_tflops": flops / (t_triton * 1e-3) / 1e12,
        "flash_ms": None,
        "flash_tflops": None,
        "ratio_to_flash": None,
        "max_abs_err_vs_flash": None,
    }
    if flash is not None:
        expected = flash().transpose(1, 2).reshape(num_seqs * query_len, n_q, head_dim)
        t_flash = bench_ms(flash, rep_ms)
        row.update(
            flash_ms=t_flash,
            flash_tflops=flops / (t_flash * 1e-3) / 1e12,
            ratio_to_flash=t_flash / t_triton,
            max_abs_err_vs_flash=(out.float() - expected.float()).abs().max().item(),
        )
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    import triton
    from workbench.kernels._common import AUTOTUNE

    dtype = DTYPES[args.dtype]
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    result: dict[str, Any] = {
        "device": props.name,
        "num_sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "dtype": args.dtype,
        "block_size": args.block_size,
        "autotune": AUTOTUNE,
        "quick": args.quick,
    }
    result["copy_bandwidth_gbps"] = copy = measure_copy_bandwidth(device, args.rep_ms)
    print(f"device {props.name}: copy bandwidth {copy:.0f} GB/s", flush=True)

    decode_rows = (
        QUICK_DECODE
        if args.quick
        else [(b, s, h) for h in DECODE_HEADS for s in DECODE_KV_LENS for b in DECODE_BATCHES]
    )
    result["decode"] = []
    for batch, kv_len, heads in decode_rows:
        row = bench_decode_row(batch, kv_len, heads, dtype, args.block_size, copy, args.rep_ms)
        result["decode"].append(row)
        torch.cuda.empty_cache()  # the row's pools are garbage now
        print(
            f"decode B={batch:3d} S={kv_len:6d} heads={heads[0]}/{heads[1]:<2d} splits={row['num_splits']:2d}: "
            f"{row['triton_gbps']:7.0f} GB/s ({100 * row['copy_fraction']:5.1f}% of copy), "
            f"x{row['speedup_vs_torch_backend']:.2f} vs torch backend, "
            f"x{row['speedup_vs_sdpa_dense']:.2f} vs dense SDPA",
            flush=True,
        )
    target_rows = [
        r
        for r in result["decode"]
        if (r["batch"], r["kv_len"], r["num_heads"], r["num_kv_heads"])
        == (DECODE_TARGET["batch"], DECODE_TARGET["kv_len"], DECODE_TARGET["num_heads"], DECODE_TARGET["num_kv_heads"])
    ]
    if not target_rows:  # the quick grid leaves it out: measure it anyway
        row = bench_decode_row(
            DECODE_TARGET["batch"],
            DECODE_TARGET["kv_len"],
            (DECODE_TARGET["num_heads"], DECODE_TARGET["num_kv_heads"]),
            dtype,
            args.block_size,
            copy,
            args.rep_ms,
        )
        result["decode"].append(row)
        target_rows = [row]

    result["prefill"] = []
    prefill_rows = list(QUICK_PREFILL if args.quick else PREFILL_ROWS)
    target_key = (PREFILL_TARGET["num_seqs"], PREFILL_TARGET["query_len"], PREFILL_TARGET["ctx_len"])
    if target_key not in prefill_rows:
        prefill_rows.append(target_key)
    for num_seqs, query_len, ctx_len in prefill_rows:
        row = bench_prefill_row(num_seqs, query_len, ctx_len, dtype, args.block_size, args.rep_ms)
        result["prefill"].append(row)
        torch.cuda.empty_cache()
        flash = "n/a" if row["flash_tflops"] is None else f"{row['flash_tflops']:.0f}"
        ratio = "n/a" if row["ratio_to_flash"] is None else f"{row['ratio_to_flash']:.2f}"
        print(
            f"prefill {num_seqs} x {query_len} after {ctx_len}: {row['triton_tflops']:6.1f} TFLOP/s "
            f"(SDPA flash {flash}, ratio {ratio})",
            flush=True,
        )
    prefill_target = next(r for r in result["prefill"] if (r["num_seqs"], r["query_len"], r["ctx_len"]) == target_key)
    frac = target_rows[0]["copy_fraction"]
    ratio = prefill_target["ratio_to_flash"]
    result["targets"] = {
        "decode": {**DECODE_TARGET, "copy_fraction": frac, "met": frac >= DECODE_TARGET["min_copy_fraction"]},
        "prefill": {
            **PREFILL_TARGET,
            "ratio_to_flash": ratio,
            "met": None if ratio is None else ratio >= PREFILL_TARGET["min_ratio_to_flash"],
        },
    }
    print(f"targets: {json.dumps(result['targets'])}", flush=True)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser(prog="python -m workbench.kernels.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--quick", action="store_true", help="a few rows only (plus the target rows)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition time per measurement")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from workbench.kernels._common import INTERPRET

    if INTERPRET:
        print("kernels/bench.py times compiled kernels: unset TRITON_INTERPRET (or set it to 0)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("kernels/bench.py needs a CUDA GPU (timing the Triton interpreter measures nothing)", file=sys.stderr)
        return 2
    result = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
