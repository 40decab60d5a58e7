"""``workbench bench soak`` at small sizes: in process (speculation and aborts on a pool that preempts: no leaked
block, no request held, the unaborted requests' greedy tokens equal to a run without speculation) and through one
``workbench serve`` process (every request answered, the dropped ones aborted, nothing left in the engine); the
engine's ``request_state`` counted by hand. The acceptance sizes (2,000 and 10,000 requests) are the README's."""

import json

import pytest

from tests.conftest import one_line_error
from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.model.checkpoint import load_model
from workbench.request import SamplingParams
from workbench.serve import soak

ORACLE = {"method": "oracle", "acceptance": 0.6, "num_speculative_tokens": 3}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def model():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model("tiny-gqa", seed=0)
    torch.set_num_threads(before)


def test_workload_marks_the_asked_share_and_every_request_joins():
    w = soak.make_workload(200, vocab_size=256, max_prompt_len=16, max_output_len=8, abort_fraction=0.1, seed=3)
    assert len(w.requests) == 200 and sum(w.joins) == 200 and len(w.aborts) == 20
    assert all(1 <= len(p) <= 16 and 1 <= n <= 8 and all(0 <= t < 256 for t in p) for p, n in w.requests)
    assert all(0 <= k < w.requests[i][1] for i, k in w.aborts.items())  # an abort comes before the last token
    assert soak.make_workload(200, 256, 16, 8, abort_fraction=0.1, seed=3) == w  # seeded


def test_request_state_counts_a_live_request_and_nothing_after_its_abort(model):
    engine = Engine(model, EngineConfig(max_model_len=64, speculative_config=ORACLE))
    assert sum(engine.request_state().values()) == 0
    rid = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.5, seed=1))
    engine.step()  # prefill and the first token, sampled: the request's generator exists
    engine.step()  # a verify step: the oracle computed the target's continuation for it
    assert engine.request_state() == {"sequences": 1, "scheduler": 1, "reported": 1, "generators": 1, "handoff": 0,
                                      "speculator": 1}  # fmt: skip
    engine.check_invariants()
    assert engine.abort(rid) is not None
    assert sum(engine.request_state().values()) == 0 and engine.stats()["num_used_blocks"] == 0


@pytest.mark.parametrize("spec", [ORACLE, NGRAM], ids=["oracle", "ngram"])
def test_engine_soak_with_speculation_and_aborts_leaks_nothing(model, spec):
    workload = soak.make_workload(100, model.config.vocab_size, 16, 16, arrival_rate=0.5, abort_fraction=0.1, seed=0)
    out = soak.soak_engine(model, workload, 0.3, speculative_config=spec, max_num_seqs=8, block_size=4)
    assert out["ok"], out
    assert out["blocks_leaked"] == 0 and out["free_blocks_at_end"] == out["pool_blocks"]
    assert out["requests_held_at_end"] == {}
    assert out["aborted"] > 0 and out["served"] + out["aborted"] == 100 and out["rejected"] == 0
    assert out["preemptions"] > 0 and out["reference_preemptions"] == 0  # the small pool was under pressure
    assert out["unaborted_tokens_match"] == f"{out['served']}/{out['served']}"
    assert out["invariant_checks"] >= out["soak_steps"] + out["aborted"]
    assert out["speculative"]["num_drafts"] > 0 and out["step_log_entries"] <= 2 * soak.STEP_LOG_STEPS


def test_growth_per_1000_is_the_least_squares_slope():
    line = [{"requests": r, "rss_mib": 500 + 0.02 * r} for r in (1000, 2000, 4000)]  # 20 MiB per 1,000 requests
    assert soak.growth_per_1000(line) == 20.0
    # a step that levelled off: readings 500, 510, 510 at 0, 1,000, 2,000 -> slope 5 (by hand: sxy 10,000 / sxx 2e6)
    assert soak.growth_per_1000([{"requests": 1000 * i, "rss_mib": y} for i, y in enumerate((500, 510, 510))]) == 5.0
    assert soak.growth_per_1000(line[:1]) is None


def test_bench_soak_command_in_process_and_a_bad_flag(capsys):
    from workbench.cli import main

    argv = ["bench", "soak", "--num-requests", "40", "--max-prompt-len", "8", "--max-output-len", "8", "--json",
            "--max-num-seqs", "4", "--block-size", "4", "--speculative-config", json.dumps(NGRAM)]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["bench"], out["model"], out["mode"], out["requests"], out["blocks_leaked"]) == (
        "soak", "tiny-gqa", "engine", 40, 0)  # fmt: skip
    rc = main(["bench", "soak", "--abort-fraction", "1.5"])
    one_line_error(capsys, rc, "--abort-fraction must be in [0, 1]")


# ---- through the server ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    pytest.importorskip("aiohttp")
    pytest.importorskip("prometheus_client")
    from workbench.serve.launch import ServerProcess

    srv = ServerProcess(["--model", "tiny-gqa", "--served-model-name", "soak", "--max-model-len", "40",
                         "--max-num-seqs", "8", "--block-size", "4", "--threads", "1",
                         "--speculative-config", json.dumps(NGRAM)])  # fmt: skip
    try:
        yield srv
    finally:
        srv.kill()


def test_server_soak_answers_every_request_and_holds_nothing_after(server):
    workload = soak.make_workload(120, 256, 16, 16, abort_fraction=0.1, seed=1)
    out = soak.soak_server(server.base_url, server.proc.pid, "soak", workload, max_concurrency=8, num_samples=4,
                           round_timeout_s=120, settle_s=10)  # fmt: skip
    assert out["failed"] == 0, out["first_error"]
    assert out["completed"] + out["dropped_by_client"] == 120 and out["dropped_by_client"] > 0
    assert out["at_end"] == {"num_requests_running": 0, "num_requests_waiting": 0, "kv_blocks_used": 0,
                             "engine_request_entries": 0}  # fmt: skip
    # the warm-up is the first 10% (12 requests), then 4 equal rounds of the other 108; RSS read after each
    assert [s["requests"] for s in out["samples"]] == [12, 39, 66, 93, 120] and out["warm_up_requests"] == 12
    assert out["rss_mib"]["warm_up"] == out["samples"][0]["rss_mib"] > 0
    assert out["rss_flat"] == (out["rss_growth_after_warm_up"] <= 0.10)
    # the speculative counters over HTTP: accepted tokens are the per-position counts summed (a proposal accepted
    # through position i counts once at each of 0 .. i), within the tokens proposed
    import urllib.request

    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
    v = soak.metric_values(text, tuple(f"workbench:spec_decode_{n}_total" for n in names))
    drafts, proposed, accepted, per_pos = v.values()
    assert 0 < drafts <= proposed and accepted == per_pos <= proposed
