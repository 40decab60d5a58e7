"""The GPU check, in one run of under 5 minutes on an H100/H200:

1. the decode executor (``workbench.engine.decode_step``): its CUDA-graph decode in bf16 (and fp32) against the
   same static step run eagerly, the eager decode mode, and transformers' greedy tokens, for both attention
   backends (``decode_check.json``);
2. the GPU kernels' tests on CUDA (bf16 and the >2**31-element pool included; the CPU ops' tests run in CI):
   pytest when importable (``-v``, so a run stopped at its time limit still counts what ran), else the
   built-in checks below (the same comparisons against ``workbench.kernels.reference`` on a smaller grid);
3. ``python -m workbench.kernels.bench`` (``--quick`` unless enough time is left);
4. the engine benchmarks on TinyLlama-1.1B-shaped random bf16 weights: ``workbench bench decode`` (torch and
   Triton backends, CUDA graphs), ``bench prefill`` and ``bench hf`` (against transformers), each with its own
   time limit; ``summary.txt`` states the targets (MBU >= 0.7 at batch 1, >= 2x transformers' decode tokens/s);
5. beyond one device, on the one GPU (``dist_check.json``): the tensor-parallel path over NCCL at
   ``tensor_parallel_size=1`` against the plain engine (same greedy tokens; the per-step overhead of the worker
   group), and a disaggregated 1:1 pair of engine processes sharing the GPU (KV over gloo staged through the host;
   over NCCL too with two GPUs or more: NCCL wants a device per rank), tokens against colocated and the bandwidth;
6. speculative decoding's verify step (``spec_check.json``): the engine with the oracle proposer (k = 4,
   acceptance 0.8) against the same engine without speculation, bf16: greedy tokens compared, tokens/s of both in
   interleaved rounds and the speed-up, at batch 1 and 8; an fp32 run whose tokens must be identical. The verify
   step (k + 1 query tokens per sequence) runs through the ragged prefill path, eagerly: the decode-step executor
   records CUDA graphs of one-token decode steps only (the baseline's decode is graphed, the verify step is not;
   the output says so).

    python scripts/gpu_check.py OUTDIR        (normally through scripts/gpu_check.sh OUTDIR)
    python scripts/gpu_check.py OUTDIR --dry-run    (CPU: steps 1, 5 and 6 on a tiny model, the rest only listed)

Needs only torch, triton and transformers (no package registry, nothing installed, no notebook stack): the
repository root goes on PYTHONPATH. Everything must finish within ``--budget-s`` (default 285 s); each step gets
what is left, capped. Exit status 0 when the decode check and every test passed and the benchmarks ran; timings
never decide it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from workbench.parsing import make_parser
from workbench.timing import now

REPO = Path(__file__).resolve().parents[1]
TEST_GLOB = "tests/test_kernels_*.py"
# the CPU kernels' tests (a g++ build of the C++ ops) and the benchmark's own test run in CI, not on the GPU box
CPU_ONLY_TESTS = {"tests/test_kernels_decode_cpu.py", "tests/test_kernels_quant_cpu.py", "tests/test_kernels_bench.py"}
FULL_BENCH_MIN_S = 200  # the full benchmark grid takes ~2-3 minutes on an H100/H200 (autotuning included)
ENGINE_MODEL = "TinyLlama-1.1B"  # the engine benchmarks' random checkpoint (bf16)
PROMPTS = [[5, 6, 7], list(range(10, 43)), [99] * 17, [1], [(7 * i) % 250 for i in range(100)]]  # batch 5: bucket 8


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["TRITON_INTERPRET"] = "0"  # tests/conftest.py defaults it to 1: the check runs compiled kernels
    env.update(extra)
    return env


def run_logged(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str]) -> tuple[int, float]:
    """Run cmd with stdout+stderr to log (and echoed); return (exit status, seconds); 124 when killed at timeout_s."""
    start = now()
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
        if now() - start >= timeout_s and rc != 0:
            f.write(f"\n[gpu_check] killed after {timeout_s:.0f} s\n")
            rc = 124
    return rc, now() - start


def junit_counts(path: Path) -> dict[str, Any] | None:
    """Outcome counts from pytest's JUnit XML; None when there is none (pytest was killed before writing it)."""
    if not path.exists():
        return None
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
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


OUTCOMES = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped", "XFAIL": "skipped"}
# pytest -v: "path::test OUTCOME [ n%]"; with xdist: "[gwN] [ n%] OUTCOME path::test"
PROGRESS_LINE = re.compile(r"^(?:(\S+::\S+) (\w+)|\[gw\d+\] \[\s*\d+%\] (\w+) (\S+::\S+))")


def log_counts(path: Path) -> dict[str, Any]:
    """Outcome counts from pytest's verbose progress lines (plain or xdist): what ran before a kill."""
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        m = PROGRESS_LINE.match(line)
        if m is None:
            continue
        name, outcome = (m[1], m[2]) if m[1] else (m[4], m[3])
        if outcome in OUTCOMES:
            counts[OUTCOMES[outcome]] += 1
            if outcome in ("FAILED", "ERROR"):
                counts["failures"].append(name)
    return counts


def run_pytest(outdir: Path, timeout_s: float) -> dict[str, Any]:
    """The GPU kernels' tests, in parallel when pytest-xdist is present (Triton compiles each shape on the CPU),
    ended gracefully by pytest-timeout's session timeout when present (so the failures' tracebacks and the JUnit
    XML are written), killed at ``timeout_s`` otherwise."""
    files = sorted(str(p.relative_to(REPO)) for p in REPO.glob(TEST_GLOB))
    files = [f for f in files if f not in CPU_ONLY_TESTS]
    xml = outdir / "tests.xml"
    cmd = [sys.executable, "-m", "pytest", *files, "-v", "--tb=short", "-p", "no:cacheprovider", "-rfE"]
    cmd.append(f"--junitxml={xml}")
    if importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(min(8, os.cpu_count() or 1))]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["--session-timeout", str(max(10, int(timeout_s) - 15))]
    # KERNELS_AUTOTUNE=0: one config per kernel, so each test shape compiles once rather than once per config
    rc, secs = run_logged(cmd, outdir / "tests.log", timeout_s, child_env(KERNELS_AUTOTUNE="0"))
    counts = junit_counts(xml)
    complete = counts is not None and rc in (0, 1)
    if counts is None:
        counts = log_counts(outdir / "tests.log")
    return {"runner": "pytest", "files": files, "returncode": rc, "seconds": secs, "complete": complete, **counts}


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
    from workbench.kernels.kv_write import kv_write
    from workbench.kernels.paged_decode import paged_decode_attention
    from workbench.kernels.paged_prefill import paged_prefill_attention
    from workbench.kernels.reference import (
        kv_write_reference,
        paged_decode_attention_reference,
        paged_prefill_attention_reference,
    )
    from workbench.kernels.testing import TOLERANCES, pad_tables, random_paged_batch, repage

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


# ---- 1. the decode executor ------------------------------------------------------------------------------------
def decode_check(outdir: Path, device: str, preset: str = "SmolLM2-135M", new_tokens: int = 24) -> dict[str, Any]:
    """Greedy tokens of ``PROMPTS`` through the engine with CUDA graphs (``capture`` on CUDA), the same static
    step run eagerly, and the eager decode mode, per backend and dtype, against transformers' ``generate`` (one
    prompt at a time: unpadded). Pass: graphs give the static-eager tokens exactly; in fp32 every mode gives
    transformers' tokens; in bf16 the first decode step's logits of graph and eager modes agree within the bf16
    tolerance (later tokens may part: bf16 rounding differs between kernels), the agreement is reported."""
    import tempfile

    import torch
    from workbench.kernels.testing import TOLERANCES

    from workbench import bench
    from workbench.engine.config import EngineConfig
    from workbench.engine.decode_step import DecodeStep
    from workbench.engine.engine import Engine
    from workbench.model import load_checkpoint, save_random_checkpoint
    from workbench.request import SamplingParams

    on_cuda = device == "cuda"
    backends = ("torch", "triton") if on_cuda else ("torch",)
    dtypes = ("bf16", "fp32") if on_cuda else ("fp32",)
    preset = preset if on_cuda else "tiny-gqa"
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in dtypes:
            path = save_random_checkpoint(preset, Path(tmp) / dtype, seed=0, dtype=dtype)
            hf = bench.load_hf_model(path, dtype, torch.device(device))
            expected = [bench.hf_generate(hf, [p], new_tokens)[0] for p in PROMPTS]
            del hf
            model = load_checkpoint(path, dtype=dtype, device=device)
            for backend in backends:
                got, first_logits = {}, {}
                for mode, capture in (("graph", on_cuda), ("static-eager", False), ("eager", False)):
                    cfg = EngineConfig(max_num_seqs=8, max_model_len=256, dtype=dtype, device=device,
                                       attention_backend=backend)  # fmt: skip
                    engine = Engine(model, cfg)
                    step = DecodeStep(model, engine.cache, engine.backend, "eager" if mode == "eager" else "graph",
                                      8, 256, capture=capture)  # fmt: skip
                    engine.runner.decode = engine.decode = step
                    seen: list[torch.Tensor] = []
                    run = step.run

                    def spy(*args, run=run, seen=seen):  # noqa: ANN002, ANN202
                        out = run(*args)
                        if not seen:
                            seen.append(out.float().clone())
                        return out

                    step.run = spy
                    got[mode] = [r.tokens for r in engine.generate(PROMPTS, sampling).requests]
                    first_logits[mode] = seen[0] if seen else None
                    if mode == "graph" and on_cuda and step.num_graphs == 0:
                        ok = False
                same = {m: sum(a == b for a, b in zip(t, expected)) for m, t in got.items()}
                row = {"dtype": dtype, "backend": backend, "prompts": len(PROMPTS), "tokens": new_tokens,
                       "graph_equals_static_eager": got["graph"] == got["static-eager"],
                       "prompts_matching_transformers": same}  # fmt: skip
                if first_logits["graph"] is not None and first_logits["eager"] is not None:
                    diff = (first_logits["graph"] - first_logits["eager"]).abs().max().item()
                    row["first_step_max_abs_logit_diff_graph_vs_eager"] = diff
                    tol = TOLERANCES[torch.bfloat16 if dtype == "bf16" else torch.float32]
                    limit = tol["atol"] + tol["rtol"] * first_logits["eager"].abs().max().item()
                    row["first_step_within_tolerance"] = diff <= limit
                    ok &= diff <= limit
                ok &= row["graph_equals_static_eager"]
                if dtype == "fp32":
                    ok &= all(v == len(PROMPTS) for v in same.values())
                rows.append(row)
                print(f"[gpu_check] decode {dtype} {backend}: {row}", flush=True)
                partial = {"ok": False, "complete": False, "preset": preset, "device": device, "rows": rows}
                (outdir / "decode_check.json").write_text(json.dumps(partial, indent=2))  # what a kill leaves
    result = {"ok": bool(ok), "complete": True, "preset": preset, "device": device, "rows": rows}
    (outdir / "decode_check.json").write_text(json.dumps(result, indent=2))
    return result


# ---- 5. beyond one device ----------------------------------------------------------------------------------------
def dist_check(outdir: Path, device: str, preset: str = "SmolLM2-135M", steps: int = 16) -> dict[str, Any]:
    """TP over the worker group at size 1 (NCCL on CUDA) against the plain engine, and a disaggregated pair."""
    import torch

    from workbench.cluster.disagg import DisaggCluster, DisaggConfig
    from workbench.engine.config import EngineConfig
    from workbench.engine.engine import Engine
    from workbench.engine.executor import start_workers
    from workbench.request import SamplingParams
    from workbench.timing import median

    dtype = "bf16" if device == "cuda" else "fp32"
    greedy = SamplingParams(max_tokens=steps, ignore_eos=True)
    config = EngineConfig(device=device, dtype=dtype, max_model_len=256, num_blocks=128, max_num_seqs=8)
    out: dict[str, Any] = {"preset": preset, "device": device, "dtype": dtype}

    def step_times(engine: Any) -> tuple[list[list[int]], float]:
        ids = [engine.add_request(p, greedy) for p in PROMPTS]
        times, done = [], {}
        while engine.has_unfinished():
            t0 = now()
            outputs = engine.step()
            times.append(now() - t0)
            done.update((o.request_id, o.result.tokens) for o in outputs if o.finished)
        tokens = [done[i] for i in ids]
        return tokens, median(times[2:] or times)

    plain_tokens, plain_step = step_times(Engine.from_model(preset, config))
    group = start_workers(preset, 1, dtype, device, 0)
    try:
        tp_engine = Engine(group.worker.model, EngineConfig(**{**vars(config), "tensor_parallel_size": 1}), group)
        tp_tokens, tp_step = step_times(tp_engine)
        out["tp1"] = {"backend": group.backend, "identical_tokens": tp_tokens == plain_tokens,
                      "plain_step_ms": plain_step * 1e3, "worker_group_step_ms": tp_step * 1e3,
                      "overhead_ms": (tp_step - plain_step) * 1e3}  # fmt: skip
    finally:
        group.shutdown()
    print(f"[gpu_check] TP=1 over {out['tp1']['backend']}: {out['tp1']}", flush=True)
    work = [(p, greedy, 0.0) for p in PROMPTS]
    out["disaggregated"] = {}
    (outdir / "dist_check.json").write_text(json.dumps({**out, "ok": False, "complete": False}, indent=2))
    # NCCL needs a device per rank: on one GPU the pair's KV goes over gloo, staged through the host (an NCCL pair
    # of two ranks on one H200 hung past the step's budget)
    nccl = device == "cuda" and torch.cuda.device_count() >= 2
    for backend in ("nccl", "gloo") if nccl else ("gloo",):
        try:
            with DisaggCluster(preset, DisaggConfig(prefill=config, decode=config, backend=backend)) as cluster:
                result = cluster.run(work, online=False)
            kv = result.kv_transfer()
            got = [r.tokens for r in result.requests]
            rate = kv["bytes"] / kv["seconds"] / 1e9 if kv["seconds"] else None
            out["disaggregated"][backend] = {"identical_tokens": got == plain_tokens, "kv_bytes": kv["bytes"],
                                             "kv_seconds": kv["seconds"], "gb_per_s": rate}  # fmt: skip
        except Exception as exc:  # a backend that cannot run here is a finding, not a crash
            out["disaggregated"][backend] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(f"[gpu_check] disaggregated over {backend}: {out['disaggregated'][backend]}", flush=True)
    ran = [d for d in out["disaggregated"].values() if "error" not in d]
    out["ok"] = bool(out["tp1"]["identical_tokens"] and ran and all(d["identical_tokens"] for d in ran))
    if device == "cuda":
        torch.cuda.empty_cache()
    (outdir / "dist_check.json").write_text(json.dumps(out, indent=2))
    return out


# ---- 6. speculative decoding's verify step -------------------------------------------------------------------------
VERIFY_GRAPHS = (
    "no: the verify step (k + 1 query tokens per sequence) runs through the ragged prefill path eagerly; the "
    "decode-step executor records CUDA graphs of one-token decode steps only (the baseline's decode is graphed)"
)


def spec_check(
    outdir: Path,
    device: str,
    preset: str = "SmolLM2-135M",
    k: int = 4,
    acceptance: float = 0.8,
    new_tokens: int = 64,
    rounds: int = 3,
    batches: tuple[int, ...] = (1, 8),
) -> dict[str, Any]:
    """Greedy tokens and tokens/s of the engine with the oracle proposer against without (module docstring, step 6).

    Per batch: both engines on the same random prompts of 32 tokens, ``new_tokens`` each (EOS ignored), one untimed
    run each (CUDA graphs recorded; the baseline's tokens become the oracle's references), then ``rounds``
    interleaved timed runs (A B, B A, ...). Pass: the proposals were verified, and in fp32 (the CPU dry run, and a
    batch-8 run on CUDA) the tokens with speculation equal those without; in bf16 the agreement is reported (the
    ragged verify kernels and the graphed decode may round differently)."""
    from workbench.engine.config import EngineConfig
    from workbench.engine.engine import Engine
    from workbench.engine.speculative import expected_tokens_per_step
    from workbench.model.checkpoint import load_model
    from workbench.request import SamplingParams
    from workbench.timing import median, random_prompts, timed

    on_cuda = device == "cuda"
    preset = preset if on_cuda else "tiny-gqa"
    spec = {"method": "oracle", "acceptance": acceptance, "num_speculative_tokens": k}
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    runs = [("bf16", b, rounds) for b in batches] + [("fp32", batches[-1], 0)] if on_cuda else [("fp32", 1, rounds)]
    rows: list[dict[str, Any]] = []
    ok = True
    models: dict[str, Any] = {}
    for dtype, batch, timed_rounds in runs:
        if dtype not in models:
            models[dtype] = load_model(preset, dtype=dtype, device=device, seed=0)
        model = models[dtype]
        prompts = random_prompts(batch, 32, model.config.vocab_size, seed=batch)
        cfg = {"device": device, "dtype": dtype, "max_num_seqs": batch, "max_model_len": 32 + new_tokens + k + 2}
        base = Engine(model, EngineConfig(**cfg))
        fast = Engine(model, EngineConfig(**cfg, speculative_config=spec))
        reference = [r.tokens for r in base.generate(prompts, params).requests]
        for p, tokens in zip(prompts, reference):
            fast.speculator.proposer.add_reference(p, tokens)
        got = [r.tokens for r in fast.generate(prompts, params).requests]
        times: dict[str, list[float]] = {"base": [], "spec": []}
        for r in range(timed_rounds):
            for name in ("base", "spec") if r % 2 == 0 else ("spec", "base"):
                eng = base if name == "base" else fast
                seconds, _ = timed(lambda eng=eng, p=prompts: eng.generate(p, params), model.device)
                times[name].append(seconds)
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(got, reference)]
        stats = fast.speculative_stats()
        row: dict[str, Any] = {
            "dtype": dtype, "batch": batch, "k": k, "acceptance": acceptance, "new_tokens": new_tokens,
            "prompts_identical": sum(d is None for d in first_diff), "prompts": batch,
            "first_divergence": [d for d in first_diff if d is not None],
            "acceptance_rate": stats["acceptance_rate"], "mean_accepted_length": stats["mean_accepted_length"],
            "expected_tokens_per_step": expected_tokens_per_step(acceptance, k),
            "baseline_cuda_graphs": on_cuda, "verify_cuda_graphs": VERIFY_GRAPHS if on_cuda else "n/a (CPU)",
        }  # fmt: skip
        if timed_rounds:
            base_s, spec_s = median(times["base"]), median(times["spec"])
            row |= {"base_tokens_per_s": batch * new_tokens / base_s, "spec_tokens_per_s": batch * new_tokens / spec_s,
                    "speedup": base_s / spec_s,
                    "speedup_per_round": [b / s for b, s in zip(times["base"], times["spec"])]}  # fmt: skip
        ok &= stats["num_drafts"] > 0
        if dtype == "fp32":
            ok &= row["prompts_identical"] == batch
        rows.append(row)
        speed = f", speed-up {row['speedup']:.2f}x" if timed_rounds else ""
        print(f"[gpu_check] speculative {dtype} batch {batch}: {row['prompts_identical']}/{batch} prompts identical"
              f"{speed}, acceptance {row['acceptance_rate']:.2f}; verify step CUDA graphs: "
              f"{row['verify_cuda_graphs']}", flush=True)  # fmt: skip
    result = {"ok": bool(ok), "preset": preset, "device": device, "rows": rows}
    (outdir / "spec_check.json").write_text(json.dumps(result, indent=2))
    return result


# ---- 4. the engine benchmarks -----------------------------------------------------------------------------------
def engine_bench_commands(ckpt: Path) -> list[tuple[str, float, list[str]]]:
    """(name, time limit in s, ``workbench`` arguments) of each engine benchmark, trimmed to ~2 minutes in all."""
    common = ["--model", str(ckpt), "--dtype", "bf16", "--device", "cuda", "--json"]
    decode = ["bench", "decode", *common, "--batch", "1", "32", "--prompt-len", "512", "--steps", "8",
              "--warmup", "2"]  # fmt: skip
    return [
        ("decode_torch", 30, decode),
        ("decode_triton", 30, [*decode, "--attention-backend", "triton"]),
        ("prefill", 20, ["bench", "prefill", *common, "--prompt-len", "512", "2048", "--repeats", "3"]),
        ("hf", 35, ["bench", "hf", *common, "--prompt-len", "128", "--new-tokens", "64", "--repeats", "1",
                    "--num-requests", "16", "--context", "512", "--max-num-seqs", "16"]),
    ]  # fmt: skip


def engine_bench(outdir: Path, budget_s: float) -> dict[str, Any]:
    """Run ``engine_bench_commands`` within ``budget_s`` (a step that does not fit is skipped, and says so)."""
    start = now()
    ckpt = outdir / "engine-ckpt"
    make = [sys.executable, "-c", f"from workbench.model import save_random_checkpoint; "
            f"save_random_checkpoint({ENGINE_MODEL!r}, {str(ckpt)!r}, seed=0, dtype='bf16')"]  # fmt: skip
    rc, _ = run_logged(make, outdir / "engine-ckpt.log", min(45.0, budget_s), child_env())
    steps: dict[str, Any] = {}
    if rc != 0:
        return {"returncode": rc, "error": "checkpoint failed; see engine-ckpt.log"}
    for name, limit, args in engine_bench_commands(ckpt):
        left = budget_s - (now() - start)
        if left < 10:
            steps[name] = {"skipped": "out of time"}
            continue
        log = outdir / f"{name}.log"
        rc, secs = run_logged([sys.executable, "-m", "workbench.cli", *args], log, min(limit, left), child_env())
        text = log.read_text()
        try:  # the JSON object is the command's stdout; warnings may precede it in the log
            result = json.loads(text[text.index("{") :])
            (outdir / f"{name}.json").write_text(json.dumps(result, indent=2))
        except ValueError:
            result = None
        steps[name] = {"returncode": rc, "seconds": secs, "result": result is not None}
    shutil.rmtree(ckpt, ignore_errors=True)
    (outdir / "summary.txt").write_text(engine_summary(outdir))
    failed = [n for n, st in steps.items() if st.get("returncode", 0) != 0 or not st.get("result", True)]
    return {"returncode": 1 if failed else 0, "steps": steps, "failed": failed}


def engine_summary(outdir: Path) -> str:
    """The engine benchmarks' figures and targets, as text."""

    def load(name: str) -> Any:
        try:
            return json.loads((outdir / f"{name}.json").read_text())
        except (OSError, ValueError):
            return None

    lines = []
    for name in ("decode_torch", "decode_triton"):
        d = load(name)
        if d is None:
            lines.append(f"{name}: no result")
            continue
        lines.append(f"{name} (read bandwidth {d['machine']['read_bandwidth'] / 1e9:.0f} GB/s):")
        for r in d["results"]:
            lines.append(f"  batch {r['batch']:>3}: {r['step_s'] * 1e3:7.3f} ms/step  {r['tokens_per_s']:9.1f} tok/s  "
                         f"mbu {r['mbu']:.3f}  gemv_ratio {r['gemv_ratio']:.3f}  overhead {r['overhead_share']:.1%}  "
                         f"cuda_graphs {r['cuda_graphs']}")  # fmt: skip
        b1 = d["results"][0]
        lines.append(f"  target MBU >= 0.7 at batch 1: {'met' if b1['mbu'] >= 0.7 else 'NOT met'} ({b1['mbu']:.3f})")
    p = load("prefill")
    for r in p["results"] if p else []:
        lines.append(f"prefill {r['prompt_len']:>5}: {r['time_s'] * 1e3:8.2f} ms  mfu {r['mfu']:.3f}")
    h = load("hf") or {}
    for key in ("decode", "offline"):
        if key in h:
            r = h[key]
            lines.append(f"hf {key}: ours {r['ours_tokens_per_s']:.1f} tok/s, transformers {r['hf_tokens_per_s']:.1f} "
                         f"tok/s, ratio {r['ratio']:.2f}, identical tokens {r['identical_tokens']}")  # fmt: skip
    if "decode" in h:
        lines.append(f"target >= 2x transformers' decode tokens/s: {'met' if h['decode']['ratio'] >= 2 else 'NOT met'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--budget-s", type=float, default=285.0, help="the whole check's time budget")
    parser.add_argument("--decode-budget-s", type=float, default=75.0, help="at most this much for step 1")
    parser.add_argument("--tests-budget-s", type=float, default=60.0, help="at most this much for the kernel tests")
    parser.add_argument(
        "--kernel-bench-budget-s", type=float, default=18.0, help="at most this for workbench.kernels.bench"
    )
    parser.add_argument("--dist-budget-s", type=float, default=45.0, help="at most this for step 5")
    parser.add_argument("--spec-budget-s", type=float, default=25.0, help="at most this for step 6")
    parser.add_argument("--dry-run", action="store_true", help="CPU: the decode check on a tiny model; list the rest")
    args = parser.parse_args(argv)
    start = now()
    outdir = args.outdir.resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    if args.dry_run:
        dist = dist_check(outdir, "cpu", preset="tiny-gqa", steps=4)
        print(f"[gpu_check] dry run: dist check {'OK' if dist['ok'] else 'FAILED'}")
        spec = spec_check(outdir, "cpu", new_tokens=16, rounds=1)
        print(f"[gpu_check] dry run: speculative check {'OK' if spec['ok'] else 'FAILED'}")
        result = decode_check(outdir, "cpu")
        for _, limit, cmd in engine_bench_commands(outdir / "engine-ckpt"):
            print(f"[gpu_check] would run ({limit} s): workbench {' '.join(cmd)}")
        print(f"[gpu_check] dry run: decode check {'OK' if result['ok'] else 'FAILED'}")
        return 0 if result["ok"] and dist["ok"] and spec["ok"] else 1
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
    t0 = now()
    # in a child process, so that a hang is bounded and the GPU memory is returned
    cmd = [sys.executable, str(Path(__file__).resolve()), str(outdir), "--decode-only"]
    rc, secs = run_logged(cmd, outdir / "decode_check.log", args.decode_budget_s, child_env())
    try:
        summary["decode"] = json.loads((outdir / "decode_check.json").read_text())
    except (OSError, ValueError):
        summary["decode"] = {"ok": False, "error": f"no result (exit {rc}); see decode_check.log"}
    summary["decode"]["seconds"] = now() - t0
    if importlib.util.find_spec("pytest") is not None:
        summary["tests"] = run_pytest(outdir, args.tests_budget_s)
    else:
        t0 = now()
        summary["tests"] = builtin_checks(outdir)
        summary["tests"]["seconds"] = now() - t0
    tests = summary["tests"]
    print(
        f"[gpu_check] tests ({tests['runner']}): {tests['passed']} passed, {tests['failed']} failed, "
        f"{tests['errors']} errors, {tests['skipped']} skipped in {tests.get('seconds', 0):.0f} s"
        + ("" if tests.get("complete", True) else " (stopped at its time limit: the counts are what ran)"),
        flush=True,
    )

    left = args.budget_s - (now() - start)
    bench_cmd = [sys.executable, "-m", "workbench.kernels.bench", "--out", str(outdir / "bench.json")]
    if min(left, args.kernel_bench_budget_s) < FULL_BENCH_MIN_S:
        bench_cmd.append("--quick")
    rc, secs = run_logged(bench_cmd, outdir / "bench.log", max(min(left - 5, args.kernel_bench_budget_s), 10),
                          child_env())  # fmt: skip
    summary["bench"] = {"returncode": rc, "seconds": secs, "quick": "--quick" in bench_cmd}
    if rc == 0 and (outdir / "bench.json").exists():
        bench = json.loads((outdir / "bench.json").read_text())
        summary["bench"]["copy_bandwidth_gbps"] = bench.get("copy_bandwidth_gbps")
        summary["bench"]["targets"] = bench.get("targets")
    reserved = 5 + args.dist_budget_s + args.spec_budget_s  # steps 5 and 6 come after the benchmarks
    summary["engine_bench"] = engine_bench(outdir, args.budget_s - (now() - start) - reserved)
    t0 = now()
    cmd = [sys.executable, str(Path(__file__).resolve()), str(outdir), "--dist-only"]
    left = args.budget_s - (now() - start) - 3 - args.spec_budget_s
    rc_dist, _ = run_logged(cmd, outdir / "dist_check.log", max(10.0, min(left, args.dist_budget_s)), child_env())
    try:
        summary["dist"] = json.loads((outdir / "dist_check.json").read_text())
    except (OSError, ValueError):
        summary["dist"] = {"ok": False, "error": f"no result (exit {rc_dist}); see dist_check.log"}
    summary["dist"]["seconds"] = now() - t0
    t0 = now()
    cmd = [sys.executable, str(Path(__file__).resolve()), str(outdir), "--spec-only"]
    left = args.budget_s - (now() - start) - 3
    rc_spec, _ = run_logged(cmd, outdir / "spec_check.log", max(10.0, min(left, args.spec_budget_s)), child_env())
    try:
        summary["spec"] = json.loads((outdir / "spec_check.json").read_text())
    except (OSError, ValueError):
        summary["spec"] = {"ok": False, "error": f"no result (exit {rc_spec}); see spec_check.log"}
    summary["spec"]["seconds"] = now() - t0
    summary["seconds"] = now() - start
    (outdir / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    print((outdir / "summary.txt").read_text() if (outdir / "summary.txt").exists() else "", flush=True)
    ok = tests["returncode"] == 0 and tests["failed"] == 0 and tests["errors"] == 0 and rc == 0
    ok = ok and summary["decode"].get("ok", False) and summary["engine_bench"]["returncode"] == 0
    ok = ok and summary["dist"].get("ok", False) and summary["spec"].get("ok", False)
    print(f"[gpu_check] {'OK' if ok else 'FAILED'} in {summary['seconds']:.0f} s; summary in {outdir}/gpu_check.json")
    return 0 if ok else 1


if __name__ == "__main__":
    if "--decode-only" in sys.argv:  # step 1 in its own process (see main)
        sys.path.insert(0, str(REPO))
        sys.exit(0 if decode_check(Path(sys.argv[1]).resolve(), "cuda")["ok"] else 1)
    if "--dist-only" in sys.argv:  # step 5 in its own process (see main)
        sys.path.insert(0, str(REPO))
        sys.exit(0 if dist_check(Path(sys.argv[1]).resolve(), "cuda")["ok"] else 1)
    if "--spec-only" in sys.argv:  # step 6 in its own process (see main)
        sys.path.insert(0, str(REPO))
        sys.exit(0 if spec_check(Path(sys.argv[1]).resolve(), "cuda")["ok"] else 1)
    sys.exit(main())
