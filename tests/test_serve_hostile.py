"""Hostile input to ``workbench serve`` (issue 35): huge and malformed bodies, wrong content types, a missing API key,
trickling clients, a busy port. One server process for the module (an API key, short read timeouts), raw sockets
and ``http.client`` as the clients; the parser's checks without a server."""

import http.client
import json
import socket
import threading
import time

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from workbench.cli import main  # noqa: E402
from workbench.serve.launch import ServerProcess  # noqa: E402
from workbench.serve.protocol import ProtocolError, error_body, parse_chat, parse_completion  # noqa: E402

ENGINE_ARGS = ["--block-size", "4", "--num-blocks", "60", "--max-num-seqs", "8"]  # max_model_len 256
KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT_S = 1.0  # --header-timeout and --body-timeout of the module's server


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    srv = ServerProcess(
        ["--model", str(tiny_checkpoint("tiny-gqa")), "--served-model-name", "tiny", *ENGINE_ARGS, "--threads", "1",
         "--header-timeout", str(TIMEOUT_S), "--body-timeout", str(TIMEOUT_S)],
        env={"WORKBENCH_API_KEY": KEY},
    )  # fmt: skip
    try:
        yield srv
    finally:
        srv.kill()


def _request(server, method, path, body=b"", headers=None, timeout_s=30.0):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout_s)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **AUTH, **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, resp.getheader("Content-Type", ""), data
    finally:
        conn.close()


def _json_error(status, ctype, data, expected_status, expected_type="invalid_request_error"):
    assert status == expected_status, data
    assert ctype.startswith("application/json"), (ctype, data)
    err = json.loads(data)["error"]
    assert err["code"] == expected_status and err["type"] == expected_type
    return err


# ---- the parser, without a server ---------------------------------------------------------------------------


class _CountingCodec:
    """A tokenizer stand-in that counts its calls: a text refused before tokenizing never reaches it."""

    has_chat_template = True

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        return [1] * 3

    def encode_chat(self, messages):
        self.calls += 1
        return [1] * 3


def test_text_that_cannot_fit_the_context_is_refused_before_tokenizing():
    # 64 tokens of context, no token over 4 bytes: at most 256 bytes of text can fit
    codec = _CountingCodec()
    parse_completion({"prompt": "a" * 256, "max_tokens": 1}, "m", codec, 300, 64, max_bytes_per_token=4)
    assert codec.calls == 1
    with pytest.raises(ProtocolError, match="at most 256 bytes") as info:
        parse_completion({"prompt": "a" * 257}, "m", codec, 300, 64, max_bytes_per_token=4)
    assert info.value.param == "prompt" and codec.calls == 1
    with pytest.raises(ProtocolError, match="has 258 bytes"):  # 'é' is two bytes in UTF-8: 129 of them are 258
        parse_completion({"prompt": "é" * 129}, "m", codec, 300, 64, max_bytes_per_token=4)
    # chat: roles and contents together; 100 messages of "user" + "xx" are 600 bytes
    many = [{"role": "user", "content": "xx"}] * 100
    with pytest.raises(ProtocolError, match="has 600 bytes") as info:
        parse_chat({"messages": many}, "m", codec, 64, max_bytes_per_token=4)
    assert info.value.param == "messages" and codec.calls == 1


@pytest.mark.parametrize(
    "chat, raw",
    [(False, '{"prompt": "\\ud800"}'), (False, '{"prompt": ["a\\udfff"]}'),
     (True, '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
     (True, '{"messages": [{"role": "\\ud800", "content": "hi"}]}')],
)  # fmt: skip
def test_a_lone_surrogate_is_a_400_naming_the_field(chat, raw):
    body = json.loads(raw)  # JSON carries it; UTF-8 cannot
    with pytest.raises(ProtocolError, match="lone surrogates") as info:
        if chat:
            parse_chat(body, "m", _CountingCodec(), 64)
        else:
            parse_completion(body, "m", _CountingCodec(), 300, 64)
    assert info.value.status == 400 and info.value.param == ("messages" if chat else "prompt")


def test_client_errors_have_a_client_error_type():
    for status in (400, 405, 408, 413, 415, 422):
        assert error_body("x", status)["error"]["type"] == "invalid_request_error"
    assert error_body("x", 401)["error"]["type"] == "authentication_error"
    assert error_body("x", 500)["error"]["type"] == "server_error"


def test_body_limit_is_sized_to_the_model():
    from workbench.serve.app import default_max_body_bytes

    assert default_max_body_bytes(256, 16) == 1024 * 1024  # 8 x 256 x 16 = 32 KiB, below the 1 MiB floor
    assert default_max_body_bytes(32768, 8) == 8 * 32768 * 8  # 2 MiB
    assert default_max_body_bytes(131072, 64) == 16 * 1024 * 1024  # 64 MiB, capped at 16 MiB


def test_the_longest_token_bounds_every_tokens_text(tiny_checkpoint):
    from workbench.model.tokenizer import TextCodec

    codec = TextCodec.from_dir(tiny_checkpoint("tiny-gqa"))
    bound = codec.max_token_bytes
    longest = max(len(codec.hf.decode([i]).encode("utf-8", "replace")) for i in range(len(codec.hf)))
    assert 1 <= longest <= bound


def test_api_key_comes_from_the_flag_then_the_environment(monkeypatch):
    import argparse

    from workbench.commands.serve import api_key_from

    monkeypatch.delenv("WORKBENCH_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert api_key_from(argparse.Namespace(api_key=None)) is None
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert api_key_from(argparse.Namespace(api_key=None)) == "v"
    monkeypatch.setenv("WORKBENCH_API_KEY", "w")
    assert api_key_from(argparse.Namespace(api_key=None)) == "w"
    assert api_key_from(argparse.Namespace(api_key="flag")) == "flag"


# ---- start-up, without a model ------------------------------------------------------------------------------


def test_a_busy_port_or_a_bad_host_fails_before_the_model_loads(capsys):
    holder = socket.create_server(("127.0.0.1", 0))
    try:
        port = holder.getsockname()[1]
        # the model does not exist: the error being about the port shows the bind came first
        assert main(["serve", "--model", "/nonexistent/model", "--port", str(port)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"cannot listen on 127.0.0.1:{port}" in err[0]
    finally:
        holder.close()
    assert main(["serve", "--model", "/nonexistent/model", "--host", "192.0.2.1", "--port", "0"]) == 2  # TEST-NET
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot listen on 192.0.2.1:0" in err[0]


def test_serve_refuses_disaggregation_flags(capsys):
    for flags in (["--disaggregate", "1:1"], ["--threads-per-engine", "2"]):
        assert main(["serve", "--model", "tiny-gqa", "--port", "0", *flags]) == 2
        assert "one colocated engine" in capsys.readouterr().err


# ---- against the server -------------------------------------------------------------------------------------


def test_without_the_api_key_v1_is_401_and_health_and_metrics_stay_open(server):
    body = json.dumps({"prompt": [1, 2], "max_tokens": 2}).encode()
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        _json_error(*_request(server, "POST", "/v1/completions", body, headers), 401, "authentication_error")
    assert _request(server, "GET", "/v1/models", headers={"Authorization": ""})[0] == 401
    assert _request(server, "POST", "/v1/completions", body)[0] == 200
    for path in ("/health", "/metrics"):
        assert _request(server, "GET", path, headers={"Authorization": ""})[0] == 200


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""])
def test_a_body_that_is_not_declared_json_is_415(server, ctype):
    body = json.dumps({"prompt": [1, 2], "max_tokens": 2}).encode()
    err = _json_error(*_request(server, "POST", "/v1/completions", body, {"Content-Type": ctype}), 415)
    assert "application/json" in err["message"]


@pytest.mark.parametrize(
    "path, raw",
    [("/v1/completions", b'{"prompt": "\\ud800"}'),
     ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
     ("/v1/chat/completions", b'{"messages": [{"role": "\\ud800", "content": "hi"}]}'),
     ("/v1/completions", b"[" * 10_000 + b"]" * 10_000),
     ("/v1/completions", b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}")],
)  # fmt: skip
def test_lone_surrogates_and_deep_nesting_are_400_json(server, path, raw):
    _json_error(*_request(server, "POST", path, raw), 400)


def test_wrong_method_and_too_large_are_client_errors(server):
    _json_error(*_request(server, "GET", "/v1/completions"), 405)
    big = json.dumps({"prompt": [1] * 400_000}).encode()  # 1.2 MB: over the tiny model's 1 MiB limit
    err = _json_error(*_request(server, "POST", "/v1/completions", big), 413)
    assert "--max-body-bytes" in err["message"]


def test_a_client_trickling_its_headers_is_disconnected(server):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10 * TIMEOUT_S + 20)
    try:
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        assert sock.recv(4096) == b""  # closed by the server (or the timeout above fails the test)
        print(f"header trickle closed after {time.monotonic() - t0:.2f} s")
    finally:
        sock.close()


def test_a_client_trickling_its_body_gets_408(server):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10 * TIMEOUT_S + 20)
    try:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
        sock.sendall(head + KEY.encode() + b'\r\nContent-Length: 100\r\n\r\n{"prompt"')
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), data
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
    finally:
        sock.close()


def _stream_gaps(server, stop, gaps):
    """Stream one long request and record the gaps between its chunks until ``stop`` is set."""
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
                 b"Bearer %s\r\nContent-Length: %d\r\n\r\n%s" % (KEY.encode(), len(body), body))  # fmt: skip
    last = None
    try:
        while not stop.is_set():
            chunk = sock.recv(65536)
            if not chunk:
                break
            now = time.monotonic()
            if last is not None:
                gaps.append((last, now))
            last = now
    finally:
        sock.close()


def _post_big(server, payload):
    """POST ``payload`` on a raw socket (the server may answer and close before it is all sent); the status line."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
                     b"Bearer %s\r\nContent-Length: %d\r\n\r\n" % (KEY.encode(), len(payload)))  # fmt: skip
        sender = threading.Thread(target=lambda: _send_quietly(sock, payload), daemon=True)
        sender.start()
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data.split(b"\r\n", 1)[0], data
    finally:
        sock.close()


def _send_quietly(sock, payload):
    try:
        sock.sendall(payload)
    except OSError:  # the server answered and closed first
        pass


def test_a_huge_text_prompt_is_refused_fast_and_another_stream_keeps_going(server):
    stop, gaps = threading.Event(), []
    streamer = threading.Thread(target=_stream_gaps, args=(server, stop, gaps), daemon=True)
    streamer.start()
    deadline = time.monotonic() + 30
    while len(gaps) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(gaps) >= 3, "the other client's stream did not start"
    timings = {}
    for name, text, expected in (("10 MB", "a" * 10_000_000, b"413"), ("500 kB", "a" * 500_000, b"400")):
        payload = json.dumps({"prompt": text, "max_tokens": 1}).encode()
        t0 = time.monotonic()
        status, data = _post_big(server, payload)
        timings[name] = (t0, time.monotonic())
        assert expected in status, data
    stop.set()
    streamer.join(timeout=60)
    for name, (t0, t1) in timings.items():
        during = [b - a for a, b in gaps if b > t0 and a < t1]
        stall = max(during, default=0.0)
        print(f"{name} text prompt refused in {t1 - t0:.3f} s; the other stream's longest gap meanwhile "
              f"{stall * 1e3:.1f} ms over {len(during)} chunks")  # fmt: skip
        # generous bounds on a loaded 2-core machine; tokenizing 10 MB on the event loop took 19.7 s
        assert t1 - t0 < 5.0 and stall < 5.0


# ---- the benchmark client -----------------------------------------------------------------------------------

BENCH = ["bench", "serve", "--dataset-name", "random", "--random-input-len", "6", "--random-output-len", "3",
         "--num-prompts", "3", "--max-concurrency", "3", "--ignore-eos", "--json"]  # fmt: skip


def test_bench_serve_chat_with_random_ids_decodes_them_with_the_tokenizer(server, tiny_checkpoint, capsys,
                                                                          monkeypatch):  # fmt: skip
    from workbench.model.tokenizer import TextCodec
    from workbench.serve.benchmark import decode_prompts, random_requests

    ckpt = str(tiny_checkpoint("tiny-gqa"))
    codec = TextCodec.from_dir(ckpt)
    reqs = decode_prompts(random_requests(3, 6, 3, 0.0, 256, seed=0), ckpt)
    for r, ids in zip(reqs, random_requests(3, 6, 3, 0.0, 256, seed=0)):
        special = set(codec.hf.all_special_ids)
        assert r.prompt == codec.hf.decode([t for t in ids.prompt if t not in special])  # the peer: HF's decode
        assert r.prompt_len == len(codec.encode(r.prompt))
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    rc = main([*BENCH, "--backend", "openai-chat", "--tokenizer", ckpt, "--base-url", server.base_url,
               "--model", "tiny"])  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert rc == 0 and result["completed"] == 3 and result["total_output_tokens"] == 9


def test_bench_serve_without_a_tokenizer_names_the_flag(capsys):
    assert main([*BENCH, "--backend", "openai-chat", "--base-url", "http://127.0.0.1:9", "--model", "m"]) == 2
    assert "--tokenizer DIR" in capsys.readouterr().err


def test_bench_serve_prints_the_reason_when_every_request_fails(server, capsys, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    assert main([*BENCH, "--base-url", server.base_url, "--model", "gpt-9"]) == 1
    err = capsys.readouterr().err
    assert "every request failed" in err and "HTTP 404" in err and "does not exist" in err
    monkeypatch.delenv("OPENAI_API_KEY")
    assert main([*BENCH, "--base-url", server.base_url, "--model", "tiny"]) == 1
    assert "HTTP 401" in capsys.readouterr().err
    free = socket.create_server(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    # a dead server is named before any request is sent: one line, exit 2 (issue 34)
    assert main([*BENCH, "--base-url", f"http://127.0.0.1:{port}", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert f"cannot connect to the server at http://127.0.0.1:{port}" in err and "Connection refused" in err
