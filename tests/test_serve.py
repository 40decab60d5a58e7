"""``workbench serve`` in a child process on 127.0.0.1 (one per module), driven by the ``openai`` client and raw HTTP.

Peer: ``workbench generate`` on the same checkpoint and engine options, one prompt at a time (the server is asked
one request at a time too, so both run the same batch-1 computation).
"""

import http.client
import json
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

from workbench.cli import main  # noqa: E402
from workbench.model.tokenizer import TextCodec  # noqa: E402
from workbench.serve.launch import ServerProcess  # noqa: E402
from workbench.serve.prom import histogram_buckets  # noqa: E402

ENGINE_ARGS = ["--block-size", "4", "--num-blocks", "60", "--max-num-seqs", "8"]  # 240 KV slots; max_model_len 256
# one torch thread on both sides: the same reduction order in every matmul, and no spinning OpenMP team on a
# loaded 2-core machine (two threads made the tiny model's steps ~20x slower there)
THREADS = 1
MODEL = "tiny"


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("tiny-gqa")


@pytest.fixture(scope="module")
def server(ckpt):
    srv = ServerProcess(["--model", str(ckpt), "--served-model-name", MODEL, *ENGINE_ARGS, "--threads", str(THREADS)])
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


def _generate(ckpt, capsys, prompt_args, max_tokens):
    rc = main(["generate", "--model", str(ckpt), *ENGINE_ARGS, "--max-new-tokens", str(max_tokens), "--json",
               *prompt_args])  # fmt: skip
    assert rc == 0
    return json.loads(capsys.readouterr().out)["requests"][0]


def _post(server, path, body, raw=False):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", path, body=body if raw else json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _get(server, path):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def _gauge(text, name):
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@pytest.mark.parametrize("prompt", ["Four score and seven years ago", "We hold these truths", [1, 5, 9, 200, 3]])
def test_greedy_completion_equals_workbench_generate(server, client, ckpt, capsys, prompt):
    args = ["--prompt", prompt] if isinstance(prompt, str) else ["--prompt-ids", ",".join(map(str, prompt))]
    ref = _generate(ckpt, capsys, [*args, "--ignore-eos"], 12)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    choice = choice_dict = got.choices[0].model_dump()
    assert choice_dict["token_ids"] == ref["tokens"]
    assert choice["text"] == ref["text"] == TextCodec.from_dir(ckpt).decode(ref["tokens"])
    assert got.usage.completion_tokens == 12 and got.usage.prompt_tokens == len(ref["prompt_ids"])
    assert choice["finish_reason"] == "length"


def test_streamed_chunks_concatenate_to_the_non_streamed_text(client):
    kwargs = dict(model=MODEL, prompt="Government of the people", max_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_continuous_usage_stats_count_the_tokens_chunk_by_chunk(client):
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it): usage in every chunk, one token per step."""
    chunks = list(client.completions.create(
        model=MODEL, prompt=[4, 5, 6], max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    ))  # fmt: skip
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == [1, 2, 3, 4, 5, 5]  # five token chunks, then the usage chunk
    assert all(c.usage.prompt_tokens == 3 for c in chunks)


def test_chat_completion_uses_the_chat_template_and_streams_the_same_text(client, ckpt, capsys):
    messages = [{"role": "user", "content": "Four score"}]
    prompt_ids = TextCodec.from_dir(ckpt).encode_chat(messages)
    ref = _generate(ckpt, capsys, ["--prompt-ids", ",".join(map(str, prompt_ids)), "--ignore-eos"], 10)
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})  # fmt: skip
    assert got.choices[0].message.content == ref["text"] and got.usage.prompt_tokens == len(prompt_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream) == ref["text"]


def _finished(text, reason):
    for line in text.splitlines():
        if line.startswith("workbench:request_success_total{") and f'finished_reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_stop_string_cuts_the_text_streamed_or_not(server, client):
    stops_before = _finished(_get(server, "/metrics")[1], "stop")
    kwargs = dict(model=MODEL, prompt="Liberty", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[10:12]
    expected = full[: full.find(stop)]
    cut = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert (cut.text, cut.finish_reason) == (expected, "stop")
    streamed = list(client.completions.create(**kwargs, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    # both ended by their stop string count as finished requests, not as aborts
    _wait_for(server, lambda t: _finished(t, "stop") == stops_before + 2)


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model=MODEL, prompt=[1, 2, 3], max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=7,
                  extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    kwargs["extra_body"]["top_k"] = kwargs.pop("top_k")
    a = client.completions.create(**kwargs).choices[0].model_dump()["token_ids"]
    b = client.completions.create(**kwargs).choices[0].model_dump()["token_ids"]
    assert a == b and len(a) == 10


BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "x", ', "not valid JSON", None),
    ("/v1/completions", b"[1, 2]", "JSON object", None),
    ("/v1/completions", {"prompt": "x", "colour": "red"}, "unknown field(s) colour", "colour"),
    ("/v1/completions", {"max_tokens": 3}, "prompt is required", "prompt"),
    ("/v1/completions", {"prompt": ""}, "empty", "prompt"),
    ("/v1/completions", {"prompt": []}, "empty", "prompt"),
    ("/v1/completions", {"prompt": [1, 256]}, "outside the vocabulary", "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "one prompt per request", "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -3}, "top_k", "top_k"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "seed": 1.5}, "seed", "seed"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop", "stop"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n=2 is not supported", "n"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "only allowed when stream",
     "stream_options"),
    ("/v1/completions", {"prompt": [1] * 300}, "maximum context length is 256", "prompt"),
    ("/v1/completions", {"prompt": [1] * 250, "max_tokens": 7}, "maximum context length", "max_tokens"),
    # fits max_model_len (256) but not the 60-block pool of 4 tokens: the engine's rejection, still a 400
    ("/v1/completions", {"prompt": [1] * 245, "max_tokens": 5}, "KV blocks", "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages must be a non-empty list", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "content must be a string", "messages"),
]  # fmt: skip


@pytest.mark.parametrize("path, body, message, param", BAD_REQUESTS)
def test_bad_input_gets_a_400_with_an_openai_error_body(server, path, body, message, param):
    status, reply = _post(server, path, body, raw=isinstance(body, bytes))
    assert status == 400, reply
    err = reply["error"]
    assert message in err["message"] and err["param"] == param and err["code"] == 400
    assert err["type"] == "invalid_request_error"


def test_openai_client_raises_bad_request_and_unknown_model_is_404(client):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=MODEL, prompt="x", top_p=2.0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-9", prompt="x")


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert _get(server, "/health")[0] == 200
    status, text = _get(server, "/metrics")
    assert status == 200
    assert _gauge(text, "workbench:kv_blocks_total") == 60
    for name in ("workbench:time_to_first_token_seconds", "workbench:inter_token_latency_seconds",
                 "workbench:e2e_request_latency_seconds"):  # fmt: skip
        buckets = histogram_buckets(text, name)
        assert buckets and buckets[-1][1] > 0  # the tests above made requests
    for name in ("workbench:num_requests_running", "workbench:num_requests_waiting", "workbench:num_preemptions_total"):
        _gauge(text, name)


def _open_stream(server, max_tokens):
    """A raw streaming request on a socket; returns the socket after the first data event."""
    body = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True}).encode()  # fmt: skip
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    seen = b""
    while b"data:" not in seen:
        chunk = sock.recv(4096)
        assert chunk, "the server closed the stream before the first event"
        seen += chunk
    return sock


def _wait_for(server, predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = _get(server, "/metrics")[1]
        if predicate(text):
            return text
        time.sleep(0.05)
    raise AssertionError(f"metrics did not reach the expected state within {timeout_s} s:\n{text}")


def _aborted(text):
    return _finished(text, "abort")


def test_a_client_disconnect_aborts_the_request_and_frees_its_blocks(server, client):
    before = _aborted(_get(server, "/metrics")[1])
    sock = _open_stream(server, max_tokens=230)  # 233 tokens: 59 of the 60 blocks by the end
    assert _gauge(_get(server, "/metrics")[1], "workbench:kv_blocks_used") > 0
    sock.close()
    text = _wait_for(server, lambda t: _aborted(t) == before + 1 and _gauge(t, "workbench:kv_blocks_used") == 0)
    assert _gauge(text, "workbench:num_requests_running") == 0
    # and the server still serves: a request that needs most of the pool completes
    got = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=200, extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 200


def test_bench_serve_against_the_server_writes_vllms_result_keys(server, tmp_path, capsys):
    before = _get(server, "/metrics")[1]
    rc = main(["bench", "serve", "--base-url", server.base_url, "--model", MODEL, "--dataset-name", "random",
               "--random-input-len", "8", "--random-output-len", "6", "--num-prompts", "6", "--request-rate", "50",
               "--burstiness", "1", "--max-concurrency", "3", "--goodput", "ttft:60000", "tpot:60000",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--ignore-eos",
               "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"])  # fmt: skip
    assert rc == 0, capsys.readouterr().out
    r = json.loads((tmp_path / "r.json").read_text())
    assert (r["completed"], r["failed"], r["total_input_tokens"], r["total_output_tokens"]) == (6, 0, 48, 36)
    assert r["output_lens"] == [6] * 6 and r["request_goodput"] == pytest.approx(r["request_throughput"])
    assert r["max_concurrent_requests"] <= 3 and r["num_prompts"] == 6 and r["max_concurrency"] == 3
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert all(f"{k}_{m}_ms" in r for k in ("mean", "median", "std", "p50", "p90", "p99"))
    # the server saw the same requests: six first tokens and 6 x 5 inter-token gaps more than before
    after = _get(server, "/metrics")[1]
    for name, n in (("workbench:time_to_first_token_seconds", 6), ("workbench:inter_token_latency_seconds", 30)):
        assert histogram_buckets(after, name)[-1][1] - histogram_buckets(before, name)[-1][1] == n
    assert sum(len(x) for x in r["itls"]) == 30


def test_sigterm_drains_the_requests_in_flight_and_exits_0(server):
    """Last in the module: it stops the shared server."""
    result = {}

    def stream():
        sock = _open_stream(server, max_tokens=100)
        data = b""
        while not data.endswith(b"0\r\n\r\n"):  # the chunked encoding's terminator
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        sock.close()
        result["body"] = data

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    _wait_for(server, lambda t: _gauge(t, "workbench:num_requests_running") == 1)
    assert server.terminate(timeout_s=30) == 0
    t.join(timeout=30)
    events = [line for line in result["body"].decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
