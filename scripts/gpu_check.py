"""The kernels' GPU check: the kernel tests on CUDA (bf16 and the >2**31-element pool included), then the benchmark.

    python scripts/gpu_check.py OUTDIR        (normally through scripts/gpu_check.sh OUTDIR)

Needs only torch, triton and transformers (no package registry, nothing installed): the repository root goes on
PYTHONPATH. The tests run with pytest when it is importable, else through the built-in checks below (the same
comparisons against ``kernels.reference`` on a smaller grid). Everything must finish within ``--budget-s``
(default 450 s, under the 8 minutes the check is allowed): the tests get at most ``--tests-budget-s``, and the
benchmark runs its full grid only when enough time is left (else ``--quick``).

Writes to OUTDIR: ``gpu_check.json`` (summary), ``tests.log`` and ``tests.xml`` or ``builtin_checks.json``,
``bench.json`` and ``bench.log``. Exit status 0 when every test passed and the benchmark ran; timings never
decide it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from workbench.parsing import make_parser

REPO = Path(__file__).resolve().parents[1]
TEST_GLOB = "tests/test_kernels_*.py"
FULL_BENCH_MIN_S = 200  # the full benchmark grid takes ~2-3 minutes on an H100/H200 (autotuning included)


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["TRITON_INTERPRET"] = "0"  # tests/conftest.py defaults it to 1: the check runs compiled kernels
    env.update(extra)
    return env


def run_logged(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str]) -> tuple[int, float]:
    """Run cmd with stdout+stderr to log (and echoed); return (exit status, seconds); 124 when killed at timeout_s."""
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        watchdog = threading.Timer(timeout_s, proc.kill)
        watchdog.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                f.write(line)
                sys.stdout.write(line)
                sys.stdout.flush()
            rc = proc.wait()
        finally:
            watchdog.cancel()
        if time.monotonic() - start >= timeout_s and rc != 0:
            f.write(f"\n[gpu_check] killed after {timeout_s:.0f} s\n")
            rc = 124
    return rc, time.monotonic() - start


def junit_counts(path: Path) -> dict[str, Any]:
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    if not path.exists():
        return counts
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None:
            counts["failed"] += 1
            counts["failures"].append(name)
        elif case.find("error") is not None:
            counts["errors"] += 1
            counts["failures"].append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def run_pytest(outdir: Path, timeout_s: float) -> dict[str, Any]:
    files = sorted(str(p.relative_to(REPO)) for p in REPO.glob(TEST_GLOB))
    xml = outdir / "tests.xml"
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "-rfEs"]
    # KERNELS_AUTOTUNE=0: one config per kernel, so each test shape compiles once rather than once per config
    rc, secs = run_logged(cmd, outdir / "tests.log", timeout_s, child_env(KERNELS_AUTOTUNE="0"))
    return {"runner": "pytest", "files": files, "returncode": rc, "seconds": secs, **junit_counts(xml)}


# ---- built-in checks: the tests' comparisons without pytest ----------------------------------------------------
def builtin_checks(
    outdir: Path, device: str = "cuda", dtype_names: tuple[str, ...] = ("float32", "float16", "bfloat16")
) -> dict[str, Any]:
    """The kernel tests' core comparisons, for a GPU box without pytest. Runs in this process.

    ``device="cpu"`` (with TRITON_INTERPRET=1 set by the caller, and fp32/fp16 only) is a dry run of this code.
    """
    if device == "cuda":
        os.environ["TRITON_INTERPRET"] = "0"
    os.environ["KERNELS_AUTOTUNE"] = "0"
    sys.path.insert(0, str(REPO))
    import torch

    from kernels.kv_write import kv_write
    from kernels.paged_decode import paged_decode_attention
    from kernels.paged_prefill import paged_prefill_attention
    from kernels.reference import (
        kv_write_reference,
        paged_decode_attention_reference,
        paged_prefill_attention_reference,
    )
    from kernels.testing import TOLERANCES, pad_tables, random_paged_batch, repage

    dev = device
    cases: list[dict[str, Any]] = []

    def check(name: str, fn) -> None:  # noqa: ANN001
        try:
            err = fn()
            cases.append({"name": name, "ok": True, "max_abs_err": err})
        except Exception:  # noqa: BLE001  (a failed case is recorded, the others still run)
            cases.append({"name": name, "ok": False, "error": traceback.format_exc(limit=3)})

    def compare(out, ref, dtype) -> float:  # noqa: ANN001
        torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[dtype])
        return (out.float() - ref.float()).abs().max().item()

    def prefill(b, **kw):  # noqa: ANN001, ANN202
        return paged_prefill_attention(
            b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.cu_seqlens_q, b.max_query_len, **kw
        )

    def prefill_ref(b):  # noqa: ANN001, ANN202
        return paged_prefill_attention_reference(
            b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.cu_seqlens_q, b.max_query_len
        )

    def decode(b, **kw):  # noqa: ANN001, ANN202
        return paged_decode_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, **kw)

    def decode_ref(b):  # noqa: ANN001, ANN202
        return paged_decode_attention_reference(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens)

    mixed = [(19, 19), (9, 42), (1, 33), (1, 1), (37, 50)]
    for dtype in [getattr(torch, name) for name in dtype_names]:
        for n_q, n_kv in ((4, 4), (8, 2), (8, 1)):
            for d in (24, 128):
                for bs in (1, 16, 32):
                    tag = f"{str(dtype)[6:]}-h{n_q}/{n_kv}-d{d}-bs{bs}"
                    b = random_paged_batch([q for q, _ in mixed], [s for _, s in mixed], n_q, n_kv, d, bs, dtype, dev)
                    check(f"prefill-{tag}", lambda b=b, dtype=dtype: compare(prefill(b), prefill_ref(b), dtype))
                    b = random_paged_batch([1] * 4, [1, 17, 40, 75], n_q, n_kv, d, bs, dtype, dev, seed=1)
                    for splits in (1, 3):
                        check(
                            f"decode-{tag}-splits{splits}",
                            lambda b=b, dtype=dtype, s=splits: compare(decode(b, num_splits=s), decode_ref(b), dtype),
                        )
    b16 = random_paged_batch([1] * 3, [3, 33, 50], 8, 2, 64, 16, torch.float32, dev)
    b1 = repage(b16, 1)
    check("decode-block1-equals-block16", lambda: compare(decode(b1), decode(b16), torch.float32))
    check(
        "decode-split-equals-nosplit",
        lambda: compare(decode(b16, num_splits=4), decode(b16, num_splits=1), torch.float32),
    )
    m16 = random_paged_batch([q for q, _ in mixed], [s for _, s in mixed], 8, 2, 64, 16, torch.float32, dev)
    check("prefill-block1-equals-block16", lambda: compare(prefill(repage(m16, 1)), prefill(m16), torch.float32))

    def kv_write_case() -> float:
        k_cache = torch.randn(8, 16, 2, 64, device=dev, dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        kr, vr = k_cache.clone(), v_cache.clone()
        k, v = torch.randn(2, 7, 2, 64, device=dev, dtype=torch.bfloat16).unbind(0)
        slots = torch.tensor([0, 5, -1, 17, 60, 127, 99], device=dev)
        kv_write(k, v, k_cache, v_cache, slots)
        kv_write_reference(k, v, kr, vr, slots)
        assert torch.equal(k_cache, kr) and torch.equal(v_cache, vr)
        return 0.0

    check("kv_write-bf16", kv_write_case)
    if device != "cuda":  # the >2**31-element pool needs ~8 GB of GPU memory
        (outdir / "builtin_checks.json").write_text(json.dumps(cases, indent=2))
        return {"runner": "builtin", "cases": cases}

    def large_pool(kind: str) -> float:
        num_blocks = 2**21 + 64  # 2**31 elements of (16, 1, 64) blocks: the last blocks need int64 offsets
        lens = [(20, 40), (70, 70)] if kind == "prefill" else [(1, 40), (1, 70)]
        b = random_paged_batch([q for q, _ in lens], [s for _, s in lens], 4, 1, 64, 16, torch.float16, dev)
        k_cache = torch.zeros((num_blocks, 16, 1, 64), dtype=torch.float16, device=dev)
        v_cache = torch.zeros_like(k_cache)
        tables = [[num_blocks - 1 - 8 * s - i for i in range(len(t))] for s, t in enumerate(b.block_tables_list)]
        for old, new in zip(b.block_tables_list, tables):
            k_cache[new] = b.k_cache[old]
            v_cache[new] = b.v_cache[old]
        bt = pad_tables(tables, dev)
        if kind == "prefill":
            out = paged_prefill_attention(b.q, k_cache, v_cache, bt, b.seq_lens, b.cu_seqlens_q, b.max_query_len)
            return compare(out, prefill_ref(b), torch.float16)
        out = paged_decode_attention(b.q, k_cache, v_cache, bt, b.seq_lens, num_splits=2)
        return compare(out, decode_ref(b), torch.float16)

    check("large-pool-int64-decode", lambda: large_pool("decode"))
    check("large-pool-int64-prefill", lambda: large_pool("prefill"))
    (outdir / "builtin_checks.json").write_text(json.dumps(cases, indent=2))
    failed = [c["name"] for c in cases if not c["ok"]]
    return {
        "runner": "builtin",
        "returncode": 1 if failed else 0,
        "passed": len(cases) - len(failed),
        "failed": len(failed),
        "errors": 0,
        "skipped": 0,
        "failures": failed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--budget-s", type=float, default=450.0, help="the whole check's time budget")
    parser.add_argument("--tests-budget-s", type=float, default=270.0, help="at most this much for the tests")
    args = parser.parse_args(argv)
    start = time.monotonic()
    outdir = args.outdir.resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        import torch
        import triton

        summary.update(
            torch=torch.__version__,
            triton=triton.__version__,
            cuda_available=torch.cuda.is_available(),
            device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        )
    except ImportError as exc:
        summary["error"] = f"cannot import torch/triton: {exc}"
        (outdir / "gpu_check.json").write_text(json.dumps(summary, indent=2))
        print(summary["error"], file=sys.stderr)
        return 2
    if not summary["cuda_available"]:
        summary["error"] = "no CUDA device: the GPU check needs one"
        (outdir / "gpu_check.json").write_text(json.dumps(summary, indent=2))
        print(summary["error"], file=sys.stderr)
        return 2

    print(f"[gpu_check] {summary['device']}: torch {summary['torch']}, triton {summary['triton']}", flush=True)
    if importlib.util.find_spec("pytest") is not None:
        summary["tests"] = run_pytest(outdir, args.tests_budget_s)
    else:
        t0 = time.monotonic()
        summary["tests"] = builtin_checks(outdir)
        summary["tests"]["seconds"] = time.monotonic() - t0
    tests = summary["tests"]
    print(
        f"[gpu_check] tests ({tests['runner']}): {tests['passed']} passed, {tests['failed']} failed, "
        f"{tests['errors']} errors, {tests['skipped']} skipped in {tests.get('seconds', 0):.0f} s",
        flush=True,
    )

    left = args.budget_s - (time.monotonic() - start)
    bench_cmd = [sys.executable, "-m", "kernels.bench", "--out", str(outdir / "bench.json")]
    if left < FULL_BENCH_MIN_S:
        bench_cmd.append("--quick")
    rc, secs = run_logged(bench_cmd, outdir / "bench.log", max(left - 5, 30), child_env())
    summary["bench"] = {"returncode": rc, "seconds": secs, "quick": "--quick" in bench_cmd}
    if rc == 0 and (outdir / "bench.json").exists():
        bench = json.loads((outdir / "bench.json").read_text())
        summary["bench"]["copy_bandwidth_gbps"] = bench.get("copy_bandwidth_gbps")
        summary["bench"]["targets"] = bench.get("targets")
    summary["seconds"] = time.monotonic() - start
    (outdir / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    ok = tests["returncode"] == 0 and tests["failed"] == 0 and tests["errors"] == 0 and rc == 0
    print(f"[gpu_check] {'OK' if ok else 'FAILED'} in {summary['seconds']:.0f} s; summary in {outdir}/gpu_check.json")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
