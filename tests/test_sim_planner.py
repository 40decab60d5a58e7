"""The capacity planner: its search space by hand, the Pareto front by hand, and a Ray run equal to a serial one
(one local Ray shared by the module's tests, every wait bounded, shut down at the end)."""

from __future__ import annotations

import json

import pytest

from workbench.cli import main
from workbench.errors import ConfigError
from workbench.sim.planner import Candidate, PlanSettings, candidates, evaluate, pareto_front, plan
from workbench.workloads import synthetic_workload

SETTINGS = PlanSettings(model="tiny-gqa", hardware="h100-sxm", slo_ttft_s=0.05, slo_tpot_s=0.002, max_model_len=256)


def small_workload():
    return synthetic_workload(40, rate=200.0, prompt_lens="uniform:16:200", output_lens="uniform:1:40", seed=5)


def test_search_space_by_hand() -> None:
    # 4 GPUs, TP {1, 2}, PP 1, one policy: colocated 1..4 x TP1 and 1..2 x TP2 = 6; disaggregated (P, D) with
    # P x ptp + D x dtp <= 4 over ptp, dtp in {1, 2}: (1,1)->(1,1),(1,2),(1,3),(2,1),(2,2),(3,1) = 6; (1,2)->(1,1)
    # (1 + 2), (2,1) (2 + 2) = 2; (2,1) -> (1,1), (1,2) = 2; (2,2) -> (1,1) = 1
    found = candidates(4, tps=(1, 2), pps=(1,), policies=("continuous",), chunk_sizes=(512,))
    colocated = [c for c in found if not c.disaggregate]
    assert sorted((c.replicas, c.tp) for c in colocated) == [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (4, 1)]
    assert len(found) - len(colocated) == 6 + 2 + 2 + 1
    assert all(c.num_gpus <= 4 for c in found)
    # a chunked policy doubles each colocated shape per chunk size
    both = candidates(4, tps=(1,), pps=(1,), policies=("continuous", "chunked"), chunk_sizes=(256, 1024),
                      disaggregated=False)  # fmt: skip
    assert len(both) == 4 * 3 and {c.chunk_size for c in both} == {None, 256, 1024}
    assert Candidate(2, 2, 1, (1, 2), 4, 1).num_gpus == 2 * (4 + 2)
    with pytest.raises(ConfigError, match="policies"):
        candidates(2, policies=("fastest",))


def test_pareto_front_by_hand() -> None:
    def row(name, g, n, ttft, tpot):
        return {"name": name, "status": "ok", "goodput_per_gpu": g, "num_gpus": n, "ttft_p90_s": ttft,
                "tpot_p90_s": tpot}  # fmt: skip

    rows = [row("a", 5.0, 1, 0.1, 0.01), row("b", 4.0, 1, 0.2, 0.01), row("c", 6.0, 2, 0.05, 0.01),
            row("d", 6.0, 2, 0.06, 0.02), {"name": "x", "status": "skipped"}]  # fmt: skip
    # b is beaten by a on everything; d by c
    assert [r["name"] for r in pareto_front(rows)] == ["a", "c"]


def test_a_candidate_that_does_not_fit_is_skipped_with_its_reason() -> None:
    settings = PlanSettings(model="Llama-2-70B", hardware="a100-80gb", slo_ttft_s=1.0, slo_tpot_s=0.1)
    row = evaluate(Candidate(tp=1), small_workload(), settings)
    assert row["status"] == "skipped" and "does not fit" in row["reason"]


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    from workbench.sim.planner import start_ray

    start_ray(num_cpus=2)  # bounded: Ray's own 30 s registration wait, three attempts
    yield ray
    ray.shutdown()


def test_ray_plan_equals_the_serial_plan(local_ray) -> None:
    requests = small_workload()
    search = candidates(2, tps=(1, 2), pps=(1,), policies=("continuous", "chunked"), chunk_sizes=(64,))
    serial = plan(requests, SETTINGS, 2, search, parallel="serial")
    on_ray = plan(requests, SETTINGS, 2, search, parallel="ray", timeout_s=120)
    assert len(serial.rows) == len(search) == 7  # 1xTP1, 2xTP1, 1xTP2, each continuous and chunked; P1:D1
    strip = lambda rows: [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]  # noqa: E731
    assert strip(on_ray.rows) == strip(serial.rows)
    assert [r["name"] for r in on_ray.best] == [r["name"] for r in serial.best]
    assert [r["name"] for r in on_ray.pareto] == [r["name"] for r in serial.pareto]
    # goodput per GPU is goodput over the candidate's GPUs
    for r in serial.rows:
        assert r["goodput_per_gpu"] == pytest.approx(r["goodput"] / r["num_gpus"])


def test_plan_command_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "tiny-gqa", "--hardware", "h100-sxm", "--num-gpus", "2", "--trace", "poisson:50",
            "--num-requests", "20", "--slo-ttft", "0.05", "--slo-tpot", "0.002", "--tp", "1,2", "--pp", "1",
            "--policies", "continuous", "--serial", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_candidates"] == len(out["rows"]) and out["best"] and out["pareto"]
    assert main([*argv[:-1], "--tp", "1,x"]) == 2
    assert "--tp" in capsys.readouterr().err


def test_evaluate_says_how_many_requests_it_clipped() -> None:
    # the library path (notebooks shape their workloads with it) caps at max_model_len and says so per row: by
    # hand, the rows whose prompt + output exceed 128 (prompts up to 200 tokens, outputs up to 40)
    from dataclasses import replace

    work = small_workload()
    too_long = sum(r.prompt_len + r.output_len > 128 for r in work)
    assert 0 < too_long < len(work)
    row = evaluate(Candidate(1, 1, 1), work, replace(SETTINGS, max_model_len=128))
    assert row["status"] == "ok" and row["num_clipped"] == too_long
