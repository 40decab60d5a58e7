"""Workload generators, trace loaders (hand-written files and the real traces), trace-stats."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from workbench.cli import main
from workbench.errors import TraceError
from workbench.workloads import (
    LengthSpec,
    Request,
    gamma_arrivals,
    load_azure_csv,
    load_mooncake_jsonl,
    load_workload,
    prefix_hit_ratio,
    prompt_token_ids,
    scale_time,
    synthetic_workload,
    trace_stats,
    truncate_to_context,
)

AZURE_SMALL = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 23:59:59.5000000,100,10
2023-11-16 23:59:59.7500000,200,20
2023-11-17 00:00:01.0000000,300,30
"""

# hand-computed prefix hits (unlimited cache, a block hits only if all before it hit too):
# r0 [1, 2]    -> 0 of 2
# r1 [1, 2, 3] -> 2 of 3
# r2 [1, 4]    -> 1 of 2
# r3 [5, 2, 3] -> 0 of 3 (2 and 3 were seen, but not after 5)
# ratio = 3 / 10
MOONCAKE_SMALL = [
    {"timestamp": 1000, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
    {"timestamp": 1500, "input_length": 1500, "output_length": 6, "hash_ids": [1, 2, 3]},
    {"timestamp": 2000, "input_length": 600, "output_length": 7, "hash_ids": [1, 4]},
    {"timestamp": 3000, "input_length": 1100, "output_length": 8, "hash_ids": [5, 2, 3]},
]


@pytest.fixture
def azure_file(tmp_path: Path) -> Path:
    path = tmp_path / "small.csv"
    path.write_text(AZURE_SMALL)
    return path


@pytest.fixture
def mooncake_file(tmp_path: Path) -> Path:
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MOONCAKE_SMALL))
    return path


def test_azure_small_file(azure_file: Path) -> None:
    reqs = load_azure_csv(azure_file)
    # arrivals relative to the first row, across midnight: 0.25 s and 1.5 s later
    assert [r.arrival_time_s for r in reqs] == pytest.approx([0.0, 0.25, 1.5])
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(100, 10), (200, 20), (300, 30)]
    assert [r.request_id for r in reqs] == [0, 1, 2]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("2023-11-16 23:59:59.7500000,2x0,20", "small.csv:3: ContextTokens must be an integer"),
        ("2023-11-16 23:59:59.7500000,200", "small.csv:3: expected 3 fields"),
        ("yesterday,200,20", "small.csv:3: bad TIMESTAMP"),
        ("2023-11-16 23:59:59.7500000,200,-1", "small.csv:3: GeneratedTokens must be >= 0"),
    ],
)
def test_azure_malformed_rows_name_file_and_line(tmp_path: Path, bad_line: str, message: str) -> None:
    lines = AZURE_SMALL.splitlines()
    lines[2] = bad_line
    path = tmp_path / "small.csv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=message):
        load_azure_csv(path)


def test_azure_bad_header(tmp_path: Path) -> None:
    path = tmp_path / "h.csv"
    path.write_text("time,in,out\n1,2,3\n")
    with pytest.raises(TraceError, match="h.csv:1: expected header"):
        load_azure_csv(path)


def test_mooncake_small_file(mooncake_file: Path) -> None:
    reqs = load_mooncake_jsonl(mooncake_file)
    assert [r.arrival_time_s for r in reqs] == pytest.approx([0.0, 0.5, 1.0, 2.0])
    assert reqs[1].hash_ids == [1, 2, 3] and reqs[1].prompt_len == 1500
    assert prefix_hit_ratio(reqs) == pytest.approx(3 / 10)
    stats = trace_stats(reqs)
    assert stats["num_requests"] == 4 and stats["duration_s"] == pytest.approx(2.0)
    assert stats["request_rate"] == pytest.approx(2.0)
    assert stats["prompt_len"]["max"] == 1500


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ('{"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1]}', "small.jsonl:2: 1 hash_ids"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 5', "small.jsonl:2: not valid JSON"),
        ('{"timestamp": 0, "output_length": 5}', "small.jsonl:2: missing key"),
        ('{"timestamp": "noon", "input_length": 1, "output_length": 5}', "small.jsonl:2: timestamp"),
    ],
)
def test_mooncake_malformed_rows(tmp_path: Path, bad: str, message: str) -> None:
    path = tmp_path / "small.jsonl"
    path.write_text(json.dumps(MOONCAKE_SMALL[0]) + "\n" + bad + "\n")
    with pytest.raises(TraceError, match=message):
        load_mooncake_jsonl(path)


def test_trace_stats_command_json(mooncake_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace-stats", str(mooncake_file), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_requests"] == 4
    assert out["duration_s"] == pytest.approx(2.0)
    assert out["request_rate"] == pytest.approx(2.0)
    assert out["prefix_hit_ratio"] == pytest.approx(0.3)
    assert main(["trace-stats", str(mooncake_file)]) == 0
    assert "0.3000" in capsys.readouterr().out
    assert main(["trace-stats", "no-such-trace"]) == 2


# ---- the real traces: row counts and first rows (README of data/traces) ----------------------------------
@pytest.mark.parametrize(
    ("name", "rows", "first", "second_arrival"),
    [
        ("azure-code", 8819, (4808, 10), 0.052),  # 18:17:04.03196 - 18:17:03.97996
        ("azure-conv", 19366, (374, 44), 4.314579),  # 18:15:50.995169 - 18:15:46.68059
        ("mooncake-conversation", 12031, (6758, 500), 0.0),
        ("mooncake-synthetic", 3993, (40160, 6), 0.0),
    ],
)
def test_real_traces(name: str, rows: int, first: tuple[int, int], second_arrival: float) -> None:
    reqs = load_workload(name)
    assert len(reqs) == rows
    assert (reqs[0].prompt_len, reqs[0].output_len) == first
    assert reqs[0].arrival_time_s == 0.0
    assert reqs[1].arrival_time_s == pytest.approx(second_arrival, abs=1e-9)
    assert all(a.arrival_time_s <= b.arrival_time_s for a, b in zip(reqs, reqs[1:]))
    if name.startswith("mooncake"):
        assert all(len(r.hash_ids) == math.ceil(r.prompt_len / 512) for r in reqs)
    if name == "mooncake-conversation":
        assert reqs[0].hash_ids == list(range(14))
    if name == "azure-code":
        # last row 19:14:19.928016, first 18:17:03.97996: 57 min 15.948056 s
        assert reqs[-1].arrival_time_s == pytest.approx(3435.948056, abs=1e-6)


def test_limit_scaling_and_truncation() -> None:
    reqs = load_workload("azure-conv", limit=3, rate_scale=2.0)
    assert len(reqs) == 3 and reqs[1].arrival_time_s == pytest.approx(4.314579 / 2)
    reqs = load_workload("azure-conv", limit=2, time_scale=3.0)
    assert reqs[1].arrival_time_s == pytest.approx(4.314579 * 3)
    with pytest.raises(TraceError, match="rate_scale"):
        scale_time(reqs, rate_scale=-1.0)
    clipped = truncate_to_context(
        [Request(0, 0.0, 100, 50), Request(1, 0.0, 200, 5, hash_ids=[7]), Request(2, 0.0, 10, 10)], max_len=120
    )
    assert [(r.prompt_len, r.output_len) for r in clipped] == [(100, 20), (119, 1), (10, 10)]
    reqs = load_workload("mooncake-conversation", limit=5, max_len=1000)
    assert all(r.prompt_len + r.output_len <= 1000 for r in reqs)
    assert all(len(r.hash_ids) == math.ceil(r.prompt_len / 512) for r in reqs)


def test_synthetic_names_and_errors() -> None:
    reqs = load_workload("poisson:2.5", limit=10)
    assert len(reqs) == 10 and reqs == load_workload("poisson:2.5", limit=10)
    assert load_workload("poisson:2.5", limit=10, seed=1) != reqs
    assert len(load_workload("gamma:1.0:3.0", num_requests=7)) == 7
    for bad in ("poisson:fast", "poisson:1:2", "gamma:1", "poisson:-1", "azure-nope"):
        with pytest.raises(TraceError):
            load_workload(bad, limit=3)


def test_arrival_processes_have_the_asked_rate_and_burstiness() -> None:
    rng = np.random.default_rng(0)
    for cv in (1.0, 3.0):
        gaps = np.diff([0.0] + gamma_arrivals(40_000, 4.0, cv, rng))
        assert gaps.mean() == pytest.approx(0.25, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_length_specs() -> None:
    rng = np.random.default_rng(0)
    assert LengthSpec.parse("fixed:7").sample(3, rng) == [7, 7, 7]
    u = LengthSpec.parse("uniform:3:5").sample(1000, rng)
    assert set(u) == {3, 4, 5}
    ln = LengthSpec.parse("lognormal:200:0.5").sample(20_000, rng)
    assert float(np.median(ln)) == pytest.approx(200, rel=0.03)
    z = LengthSpec.parse("zipf:1.0:4").sample(50_000, rng)
    # P(k) = (1/k) / (1 + 1/2 + 1/3 + 1/4) -> P(1) = 12/25
    assert min(z) == 1 and max(z) == 4
    assert z.count(1) / len(z) == pytest.approx(12 / 25, rel=0.03)
    for bad in ("fixed:0", "uniform:5:3", "zipf:1", "normal:3:4", "fixed:x"):
        with pytest.raises(TraceError, match="length spec"):
            LengthSpec.parse(bad)
    reqs = synthetic_workload(5, 1.0, prompt_lens="fixed:9", output_lens="fixed:2")
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(9, 2)] * 5


def test_prompt_token_ids_follow_hash_ids() -> None:
    a = Request(0, 0.0, 1024, 4, hash_ids=[1, 2])
    b = Request(1, 0.0, 700, 4, hash_ids=[1, 3])
    c = Request(2, 0.0, 600, 4, hash_ids=[1, 2])
    ta, tb, tc = (prompt_token_ids(r, vocab_size=1000, seed=5) for r in (a, b, c))
    assert len(ta) == 1024 and len(tb) == 700 and len(tc) == 600
    assert ta[:512] == tb[:512] == tc[:512]
    assert ta[512:600] == tc[512:600]  # a partial last block is a prefix of the same block
    assert ta[512:700] != tb[512:700]
    assert all(0 <= t < 1000 for t in ta)
    assert prompt_token_ids(a, 1000, seed=6) != ta
    plain = Request(3, 0.0, 50, 4)
    assert prompt_token_ids(plain, 100) == prompt_token_ids(plain, 100)
    assert prompt_token_ids(Request(4, 0.0, 50, 4), 100) != prompt_token_ids(plain, 100)
