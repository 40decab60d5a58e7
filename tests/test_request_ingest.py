"""One request ingest (issue 34): the same oversized request gets the same decision and the same message through
every entry point (the HTTP server, ``generate``, the engine API, a trace row in ``replay`` and ``simulate``, the
simulator's disaggregated pools): vLLM's rule, a prompt + ``max_tokens`` beyond ``max_model_len`` is rejected, never
capped, and the requests around it are served.

Cheap: tiny-gqa (256 positions) with random weights, a handful of tokens per request."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.conftest import one_line_error
from workbench import cli
from workbench.errors import RequestError
from workbench.request import SamplingParams, default_max_tokens, validate_request
from workbench.workloads import Request

MAX_MODEL_LEN = 256  # tiny-gqa's max_position_embeddings, below the 4096 default cap
PROMPT_LEN, MAX_TOKENS = 250, 10  # 260 tokens in all: 4 beyond the context
# written by hand (not copied from a run): the one message every entry point gives
EXPECTED = (
    "this model's maximum context length is 256 tokens; the prompt has 250 and max_tokens asks for 10 more "
    "(260 in all): shorten the prompt, lower max_tokens, or serve with a larger max_model_len"
)


def test_the_rule_and_its_fields() -> None:
    with pytest.raises(RequestError) as exc:
        validate_request([1] * PROMPT_LEN, MAX_TOKENS, MAX_MODEL_LEN, vocab_size=512)
    assert str(exc.value) == EXPECTED and exc.value.param == "max_tokens"
    validate_request(PROMPT_LEN, 6, MAX_MODEL_LEN)  # 250 + 6 = 256 fits exactly
    with pytest.raises(RequestError, match="the prompt has 300") as exc:
        validate_request(300, 1, MAX_MODEL_LEN)
    assert exc.value.param == "prompt"  # the prompt alone is too long: lowering max_tokens cannot help
    with pytest.raises(RequestError, match="outside the vocabulary") as exc:
        validate_request([1, 512], 1, MAX_MODEL_LEN, vocab_size=512)
    assert exc.value.param == "prompt"
    with pytest.raises(RequestError, match="empty prompt"):
        validate_request([], 1, MAX_MODEL_LEN)
    # max_tokens unset (chat): the room the prompt leaves; a prompt that fills the context has none
    assert default_max_tokens(PROMPT_LEN, MAX_MODEL_LEN) == 6
    with pytest.raises(RequestError, match="the prompt has 256 and max_tokens asks for 1 more"):
        validate_request(256, default_max_tokens(256, MAX_MODEL_LEN), MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def engine():
    from workbench.engine.config import EngineConfig
    from workbench.engine.engine import Engine

    eng = Engine.from_model("tiny-gqa", EngineConfig(device="cpu"), seed=0)
    assert eng.max_model_len == MAX_MODEL_LEN
    yield eng
    eng.shutdown()


def test_engine_api_rejects_it_and_serves_the_others(engine) -> None:
    big = engine.add_request([1] * PROMPT_LEN, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    small = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    outs = {}
    while engine.has_unfinished():
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    assert outs[big].finish_reason == "rejected" and outs[big].reject_reason == EXPECTED
    assert outs[small].finish_reason == "length" and len(outs[small].result.tokens) == 4


def test_a_workload_row_through_the_engine_gets_the_same_decision(engine) -> None:
    rows = [Request(0, 0.0, 8, 3), Request(1, 0.0, PROMPT_LEN, MAX_TOKENS), Request(2, 0.0, 5, 2)]
    result = engine.replay(rows)
    by_id = {r.request_id: r for r in result.requests}
    assert by_id[1].finish_reason == "rejected" and by_id[1].reject_reason == EXPECTED
    assert [len(by_id[i].tokens) for i in (0, 2)] == [3, 2]  # the others in full, not capped


def test_http_gives_a_400_with_the_same_message(engine) -> None:
    pytest.importorskip("aiohttp")
    from aiohttp.test_utils import TestClient, TestServer

    from workbench.serve.app import build_app

    async def post(body: dict) -> tuple[int, dict]:
        async with TestClient(TestServer(build_app(engine, None, "tiny"))) as client:
            resp = await client.post("/v1/completions", json=body)
            return resp.status, await resp.json()

    status, reply = asyncio.run(post({"prompt": [1] * PROMPT_LEN, "max_tokens": MAX_TOKENS}))
    assert status == 400 and reply["error"]["message"] == EXPECTED and reply["error"]["param"] == "max_tokens"


def test_generate_rejects_it_and_serves_the_others(capsys) -> None:
    rc = cli.main(["generate", "--model", "tiny-gqa", "--device", "cpu", "--prompt-ids", "1,2",
                   "--prompt-ids", ",".join(["1"] * PROMPT_LEN), "--max-new-tokens", str(MAX_TOKENS), "--ignore-eos",
                   "--json"])  # fmt: skip
    out = capsys.readouterr()
    reqs = json.loads(out.out)["requests"]
    assert rc == 1 and [r["finish_reason"] for r in reqs] == ["length", "rejected"]
    assert reqs[1]["reject_reason"] == EXPECTED and len(reqs[0]["tokens"]) == MAX_TOKENS
    assert f"request 1 rejected: {EXPECTED}" in out.err


def _trace(tmp_path) -> str:
    """Four rows 0.01 s apart; row 1 (250 + 10) and row 3 (300 + 2) do not fit 256 positions."""
    rows = [(8, 3), (PROMPT_LEN, MAX_TOKENS), (5, 2), (300, 2)]
    path = tmp_path / "rows.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    + "".join(f"2023-11-16 18:00:00.0{i},{p},{o}\n" for i, (p, o) in enumerate(rows)))  # fmt: skip
    return str(path)


@pytest.mark.parametrize(
    "command, extra",
    [("replay", []), ("simulate", ["--hardware", "h100-sxm"]), ("simulate", ["--disaggregate", "1:1"])],
    ids=["replay", "simulate", "simulate-disaggregated"],
)
def test_trace_rows_beyond_the_context_are_rejected_counted_and_named(tmp_path, capsys, command, extra) -> None:
    argv = [command, "--model", "tiny-gqa", "--trace", _trace(tmp_path), "--json", *extra]
    assert cli.main(argv) == 0  # the others were served
    out = capsys.readouterr()
    summary = json.loads(out.out)
    assert summary["num_requests"] == 4 and summary["num_finished"] == 2 and summary["num_rejected"] == 2
    assert summary["first_rejected"] == {"request_id": 1, "reason": EXPECTED}
    assert sorted(r["request_id"] for r in summary["rejected"]) == [1, 3]
    assert "num_clipped" not in summary
    assert f"2 of 4 requests rejected (the others were served); the first, request 1: {EXPECTED}" in out.err


def test_plan_plans_on_the_rows_that_fit_and_counts_the_others(tmp_path, capsys) -> None:
    argv = ["plan", "--model", "tiny-gqa", "--hardware", "h100-sxm", "--num-gpus", "1", "--trace", _trace(tmp_path),
            "--slo-ttft", "1", "--slo-tpot", "0.1", "--tp", "1", "--pp", "1", "--policies", "continuous",
            "--no-disaggregate", "--serial"]  # fmt: skip
    assert cli.main([*argv, "--json"]) == 0  # used to clip rows 1 and 3 to 256 tokens and plan on all four
    out = capsys.readouterr()
    summary = json.loads(out.out)
    assert summary["num_requests"] == 4 and summary["num_rejected"] == 2 and "num_clipped" not in summary
    assert summary["first_rejected"] == {"request_id": 1, "reason": EXPECTED}
    assert f"2 of 4 requests rejected (planned on the others); the first, request 1: {EXPECTED}" in out.err
    # every row beyond a 6-token context (8 + 3, 250 + 10, 5 + 2, 300 + 2): nothing to plan for, one line
    rc = cli.main([*argv, "--max-model-len", "6"])
    one_line_error(capsys, rc, "all 4 requests of the trace exceed max_model_len 6", "the first: this model's")
