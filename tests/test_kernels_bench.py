"""The benchmark's cost formulas (hand-computed) and its PyTorch peers (against the fp32 reference), on CPU.

Timing itself needs a GPU (``scripts/gpu_check.sh``); here only what the numbers are made of is checked.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from workbench.kernels._common import INTERPRET
from workbench.kernels.bench import decode_bytes, main, prefill_flops, sdpa_dense_decode, torch_paged_decode
from workbench.kernels.reference import paged_decode_attention_reference
from workbench.kernels.testing import random_paged_batch

from workbench.kernels import bench
from workbench.roofline import attended_pairs

REPO = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def test_cost_formulas_by_hand():
    # batch 2, 10 tokens, 1 KV head of 4 dims, fp16: K and V 2*2*10*1*4*2 = 320 bytes; q and out 2*2*3*4*2 = 96
    assert decode_bytes(2, 10, 3, 1, 4, 2) == 320 + 96
    assert attended_pairs(2, 0) == 3  # query 0 sees 1 key, query 1 sees 2
    assert attended_pairs(2, 3) == 4 + 5  # after 3 cached tokens: 4 and 5 keys
    assert prefill_flops(2, 2, 3, 5, 8) == 4 * 8 * 5 * 2 * 9


def test_torch_peers_match_reference():
    seq_len, bs = 43, 16  # the bench gives every sequence the same length
    batch = random_paged_batch([1, 1, 1], [seq_len] * 3, 8, 2, 32, bs, torch.float32, "cpu", seed=4)
    scale = 32**-0.5
    expected = paged_decode_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale
    )
    out = torch_paged_decode(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, seq_len, scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    ids = batch.block_tables.long()
    k = batch.k_cache[ids].view(3, -1, 2, 32)[:, :seq_len].transpose(1, 2).contiguous()  # (B, kv_heads, S, d)
    v = batch.v_cache[ids].view(3, -1, 2, 32)[:, :seq_len].transpose(1, 2).contiguous()
    torch.testing.assert_close(sdpa_dense_decode(batch.q, k, v, scale), expected, atol=1e-5, rtol=1e-5)


def test_rows_run_end_to_end_on_cpu(monkeypatch):
    """The row functions end to end (on CPU through the interpreter), with timing replaced by one call (1 ms)."""
    monkeypatch.setattr(bench, "bench_ms", lambda fn, rep_ms: (fn(), 1.0)[1])
    row = bench.bench_decode_row(3, 40, (8, 2), torch.float32, 16, 1.0, 10, DEVICE, head_dim=24)
    assert row["max_abs_err_vs_torch"] < 1e-4
    assert row["triton_gbps"] == decode_bytes(3, 40, 8, 2, 24, 4) / 1e-3 / 1e9
    assert "split_sweep" not in row  # only the target row sweeps the split count
    row = bench.bench_prefill_row(2, 20, 13, torch.float32, 16, 10, DEVICE, head_dim=24, heads=(4, 2))
    assert row["flops"] == prefill_flops(2, 20, 13, 4, 24)
    if row["flash_tflops"] is not None:  # flash ran (torch's CPU build has one for fp32): then it must agree
        assert row["max_abs_err_vs_flash"] < 1e-4


def test_help_runs_without_a_gpu():
    proc = subprocess.run(
        [sys.executable, "-m", "workbench.kernels.bench", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--out" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_a_gpu(capsys):
    assert main([]) == 2
    assert "TRITON_INTERPRET" in capsys.readouterr().err  # the test session runs under the interpreter


def test_gpu_check_counts_a_killed_pytest_run_from_its_verbose_log(tmp_path):
    # scripts/gpu_check.py: pytest killed at its time limit writes no JUnit XML; the counts come from its -v lines
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.junit_counts(tmp_path / "absent.xml") is None
    log = tmp_path / "tests.log"
    plain = (
        "============ test session starts ============\n"
        "tests/test_kernels_decode.py::test_a[bf16] PASSED                      [  1%]\n"
        "tests/test_kernels_decode.py::test_a[fp32] PASSED                      [  2%]\n"
        "tests/test_kernels_decode.py::test_b FAILED                            [  3%]\n"
        "tests/test_kernels_prefill.py::test_c SKIPPED (needs a GPU)            [  4%]\n"
        "tests/test_kernels_prefill.py::test_d ERROR                            [  5%]\n"
    )
    xdist = (  # pytest-xdist's progress lines
        "[gw0] [ 33%] PASSED tests/test_kernels_decode.py::test_a[bf16] \n"
        "[gw1] [ 66%] FAILED tests/test_kernels_decode.py::test_b \n"
        "[gw0] [100%] SKIPPED tests/test_kernels_prefill.py::test_c \n"
    )
    summary = "FAILED tests/test_kernels_decode.py::test_b - AssertionError\n"  # -rfE's line: not counted again
    b, d = "tests/test_kernels_decode.py::test_b", "tests/test_kernels_prefill.py::test_d"
    expected = {plain: ((2, 1, 1, 1), [b, d]), xdist: ((1, 1, 1, 0), [b])}
    for text, (outcomes, failures) in expected.items():
        log.write_text(text + summary)
        counts = gpu_check.log_counts(log)
        assert (counts["passed"], counts["failed"], counts["skipped"], counts["errors"]) == outcomes
        assert counts["failures"] == failures
