"""The benchmark client's arithmetic (vLLM's definitions, checked on hand-made requests), the Prometheus quantiles,
and the request parser, without a server."""

import math

import numpy as np
import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from workbench.errors import ConfigError  # noqa: E402
from workbench.serve.benchmark import (  # noqa: E402
    RequestOutput,
    arrival_gaps,
    compute_result,
    parse_goodput,
    random_requests,
    result_filename,
)
from workbench.serve.prom import ServerMetrics, bucket_delta, histogram_buckets, histogram_quantile  # noqa: E402
from workbench.serve.protocol import ProtocolError, parse_completion  # noqa: E402


def _out(ttft, itl, n_out, prompt_len=10, start=0.0):
    return RequestOutput(success=True, prompt_len=prompt_len, output_tokens=n_out, ttft=ttft, itl=itl,
                         latency=ttft + sum(itl), start_time=start)  # fmt: skip


def test_compute_result_by_hand():
    # request a: ttft 0.1, gaps 0.02, 0.04 -> e2el 0.16, tpot (0.16 - 0.1) / 2 = 0.03
    # request b: ttft 0.3, one token -> e2el 0.3, no tpot; request c failed
    outs = [_out(0.1, [0.02, 0.04], 3), _out(0.3, [], 1, prompt_len=20, start=1.5), RequestOutput(error="HTTP 400")]
    r = compute_result(outs, duration=2.0, selected=["ttft", "tpot", "itl", "e2el"], percentiles=[50, 99],
                       goodput={"ttft": 200.0})  # fmt: skip
    assert (r["completed"], r["failed"], r["total_input_tokens"], r["total_output_tokens"]) == (2, 1, 30, 4)
    assert r["request_throughput"] == pytest.approx(1.0) and r["output_throughput"] == pytest.approx(2.0)
    assert r["total_token_throughput"] == pytest.approx(17.0)
    assert r["request_goodput"] == pytest.approx(0.5)  # only a meets ttft <= 200 ms
    assert r["mean_ttft_ms"] == pytest.approx(200.0) and r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["std_ttft_ms"] == pytest.approx(100.0)
    assert r["mean_tpot_ms"] == pytest.approx(30.0)
    assert r["mean_itl_ms"] == pytest.approx(30.0) and r["p50_itl_ms"] == pytest.approx(30.0)
    assert r["p99_itl_ms"] == pytest.approx(20 + 20 * 0.99)  # numpy's linear interpolation between 20 and 40
    assert r["mean_e2el_ms"] == pytest.approx(230.0)
    assert r["max_concurrent_requests"] == 1  # a ends at 0.16 s, b starts at 1.5 s
    assert r["max_output_tokens_per_s"] == 3  # a's three tokens in [0, 1) s, b's one in [1, 2) s
    assert r["errors"] == ["", "", "HTTP 400"] and r["itls"][0] == [0.02, 0.04]


def test_no_goodput_slos_gives_none_and_bad_slos_are_refused():
    assert compute_result([_out(0.1, [], 1)], 1.0, ["ttft"], [99], {})["request_goodput"] is None
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"]):
        with pytest.raises(ConfigError):
            parse_goodput(bad)


def test_arrival_gaps_follow_the_rate_and_burstiness():
    assert arrival_gaps(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    gaps = np.array(arrival_gaps(20000, 4.0, 0.5, 0))
    # gamma(shape k, scale 1/(rate k)): mean 1/rate, coefficient of variation 1/sqrt(k)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(0.5), rel=0.05)


def test_random_requests_lengths_and_ids():
    reqs = random_requests(200, 100, 10, 0.5, 256, seed=0)
    lens = [r.prompt_len for r in reqs]
    assert min(lens) >= 50 and max(lens) <= 150 and all(len(r.prompt) == r.prompt_len for r in reqs)
    assert all(0 <= t < 256 for r in reqs for t in r.prompt)
    assert all(5 <= r.output_len <= 15 for r in reqs)
    assert random_requests(3, 100, 10, 0.0, 256, seed=0)[0].prompt_len == 100


def test_result_filename_is_vllms():
    assert result_filename("openai", 4.0, 8, "/ckpt/tiny", "20260101-000000") == (
        "openai-4.0qps-concurrency8-tiny-20260101-000000.json"
    )


def test_histogram_quantile_by_hand():
    buckets = [(1.0, 2.0), (2.0, 6.0), (math.inf, 8.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(1.5)  # rank 4: 1 + (4 - 2) / (6 - 2)
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.4)  # rank 0.8 in [0, 1]
    assert histogram_quantile(0.99, buckets) == 2.0  # in the +Inf bucket: the highest finite bound
    assert math.isnan(histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]))
    assert bucket_delta([(1.0, 5.0), (math.inf, 9.0)], [(1.0, 2.0), (math.inf, 3.0)]) == [(1.0, 3.0), (math.inf, 6.0)]


def test_server_histograms_read_back():
    m = ServerMetrics("m")
    for v in (0.001, 0.002, 0.004, 0.008):
        m.ttft.observe(v)
    buckets = histogram_buckets(m.render().decode(), "workbench:time_to_first_token_seconds")
    assert buckets[-1] == (math.inf, 4.0)
    assert dict(buckets)[0.002] == 2.0 and dict(buckets)[0.005] == 3.0


@pytest.mark.parametrize(
    "body, param",
    [({"prompt": [1], "logprobs": 3}, "logprobs"), ({"prompt": [1], "echo": True}, "echo"),
     ({"prompt": [1], "ignore_eos": "yes"}, "ignore_eos"), ({"prompt": [1], "stream": 1}, "stream"),
     ({"prompt": "text"}, "prompt"), ({"prompt": [1.5]}, "prompt")],
)  # fmt: skip
def test_parser_names_the_field(body, param):
    with pytest.raises(ProtocolError) as info:
        parse_completion(body, "m", codec=None, vocab_size=256, max_model_len=64)
    assert info.value.param == param and info.value.status == 400


def test_parser_accepts_vllm_bench_serve_payload():
    body = {"model": "m", "prompt": [1, 2], "temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 5,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "top_k": -1}  # fmt: skip
    req = parse_completion(body, "m", codec=None, vocab_size=256, max_model_len=64)
    assert req.stream and req.include_usage and req.sampling.ignore_eos and req.sampling.max_tokens == 5
    assert req.sampling.top_k == 0 and req.sampling.temperature == 0.0


def test_serve_seed_gives_each_unseeded_request_seed_plus_its_index():
    import json

    from workbench.serve.app import ServerLimits, ServerState, _parse

    # serve --seed 2**64 - 2: request i (arrival order) without a seed samples with seed + i modulo 2**64, as
    # generate --seed does; a request's own seed is kept (and still counts as an arrival)
    state = ServerState(None, None, "m", 64, 256, limits=ServerLimits(seed=2**64 - 2))  # type: ignore[arg-type]
    bodies = [{"prompt": [1], "max_tokens": 2}, {"prompt": [1], "max_tokens": 2, "seed": 11},
              {"prompt": [1], "max_tokens": 2}, {"prompt": [1], "max_tokens": 2}]  # fmt: skip
    seeds = [_parse(state, json.dumps(b).encode(), chat=False).sampling.seed for b in bodies]
    assert seeds == [2**64 - 2, 11, 0, 1]
    unseeded = ServerState(None, None, "m", 64, 256)  # type: ignore[arg-type]
    assert _parse(unseeded, json.dumps(bodies[0]).encode(), chat=False).sampling.seed is None
    for state_ in (state, unseeded):
        state_.parser.shutdown()


def test_chat_needs_a_tokenizer_with_a_chat_template():
    from workbench.config import ModelConfig
    from workbench.model.tokenizer import TextCodec, train_tokenizer
    from workbench.serve.protocol import parse_chat

    body = {"messages": [{"role": "user", "content": "hi"}]}
    plain = TextCodec(train_tokenizer(ModelConfig.resolve("tiny-gqa"), chat_template=None))
    for codec, what in ((None, "no tokenizer"), (plain, "without a chat template")):
        with pytest.raises(ProtocolError, match=what) as info:
            parse_chat(body, "m", codec, max_model_len=64)
        assert info.value.status == 400
    with_template = TextCodec(train_tokenizer(ModelConfig.resolve("tiny-gqa")))
    req = parse_chat(body, "m", with_template, max_model_len=64)
    assert with_template.decode(req.prompt_ids) == "user: hi\nassistant:"
    assert req.sampling.max_tokens == 64 - len(req.prompt_ids)  # chat's default: the rest of the context


def test_sharegpt_and_trace_datasets(tmp_path, tiny_checkpoint):
    import json

    from workbench.model.tokenizer import TextCodec
    from workbench.serve.benchmark import sharegpt_requests, trace_requests
    from workbench.workloads import load_workload

    ckpt = tiny_checkpoint("tiny-gqa")
    convs = [{"conversations": [{"from": "human", "value": f"We hold these truths {i}"},
                                {"from": "gpt", "value": "to be self-evident"}]} for i in range(3)]  # fmt: skip
    convs.append({"conversations": [{"from": "human", "value": "alone"}]})  # one turn: skipped
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    reqs = sharegpt_requests(str(path), 3, str(ckpt), None, seed=0)
    codec = TextCodec.from_dir(ckpt)
    assert sorted(r.prompt for r in reqs) == [f"We hold these truths {i}" for i in range(3)]
    assert all(r.prompt_len == len(codec.encode(r.prompt)) for r in reqs)
    assert all(r.output_len == len(codec.encode("to be self-evident")) for r in reqs)
    with pytest.raises(ConfigError, match="only 3 usable"):
        sharegpt_requests(str(path), 4, str(ckpt), None, seed=0)
    with pytest.raises(ConfigError, match="--tokenizer"):
        sharegpt_requests(str(path), 3, None, None, seed=0)

    trace = load_workload("azure-conv", limit=5)
    reqs, left_out = trace_requests("azure-conv", 5, None, 256, seed=0)
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(t.prompt_len, t.output_len) for t in trace]
    assert all(len(r.prompt) == r.prompt_len for r in reqs) and left_out == 0
    # a server of 512 positions: the rows beyond it are left out (counted), the others sent as they are, never clipped
    rows = [(t.prompt_len, t.output_len) for t in load_workload("azure-conv", limit=200)]
    fitting = [i for i, (p, o) in enumerate(rows) if p + o <= 512][:5]
    fit, left_out = trace_requests("azure-conv", 5, 512, 256, seed=0)
    assert [(r.prompt_len, r.output_len) for r in fit] == [rows[i] for i in fitting]
    assert left_out == fitting[-1] + 1 - 5 >= 1  # the trace's third row, 879 + 55, among them
