"""``workbench serve``: an OpenAI-compatible HTTP server over the engine, on aiohttp.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (when the tokenizer has a chat template),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text, ``workbench.serve.prom``).

A request's life: its body is checked (``workbench.serve.protocol``; a 400 with OpenAI's error body otherwise), it
is queued on the ``AsyncEngine``, and the handler waits for its first output: a rejection by the engine (a prompt
the KV pool can never hold) is still a 400, since nothing was sent yet. Then it streams server-sent events (one
``data:`` chunk per step's new text, a last chunk with ``finish_reason``, the usage chunk with
``stream_options.include_usage``, then ``data: [DONE]``) or returns one JSON object. Text comes out of an
``IncrementalDetokenizer``, so the streamed chunks concatenate to the non-streamed text; a stop string ends the
text before it and aborts the request in the engine. A client that goes away (aiohttp cancels its handler) has its
request aborted and its KV blocks freed; the others keep streaming.

Hostile input: a body larger than ``max_body_bytes`` is a 413 (by default sized to what the context can hold), a
body not received within ``body_timeout_s`` a 408, a connection that has not sent a request's headers within
``header_timeout_s`` is closed; ``POST`` bodies must be ``Content-Type: application/json`` (a 415 otherwise, so that a
web page cannot make a browser send a CORS "simple request" that generates); text that cannot fit the context
(``protocol.check_text_fits``) is a 400 before it is tokenized, and parsing and tokenizing run on one worker thread,
off the event loop, so one large prompt does not stall the other clients' streams. With ``api_key``, the ``/v1``
routes need ``Authorization: Bearer KEY`` (a 401 otherwise); ``/health`` and ``/metrics`` stay open unless
``api_key_all_routes``.

SIGTERM or SIGINT: the server stops admitting (503), lets the requests in flight finish for up to
``drain_timeout_s``, aborts the rest, and returns (``workbench serve`` then exits 0).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from workbench.engine.engine import Engine
from workbench.request import SEED_LIMIT
from workbench.serve.async_engine import AsyncEngine, Output, RequestHandle
from workbench.serve.prom import ServerMetrics
from workbench.serve.protocol import (
    DEFAULT_MAX_BYTES_PER_TOKEN,
    GenerationRequest,
    ProtocolError,
    error_body,
    parse_chat,
    parse_completion,
)
from workbench.timing import unix_time

log = logging.getLogger("workbench.serve")
MAX_BODY_BYTES = 16 * 1024 * 1024  # the ceiling of the default body limit
MIN_BODY_BYTES = 1024 * 1024  # its floor
BODY_BYTES_PER_TOKEN_SLOTS = 8  # a JSON body may spend 8x the text it carries (escapes, token-id lists, fields)


def default_max_body_bytes(max_model_len: int, max_bytes_per_token: int) -> int:
    """The body limit sized to the model: room for ``max_model_len`` tokens of the longest text, 8x for JSON, within
    [1 MiB, 16 MiB]."""
    want = BODY_BYTES_PER_TOKEN_SLOTS * max_model_len * max_bytes_per_token
    return max(MIN_BODY_BYTES, min(MAX_BODY_BYTES, want))


@dataclass
class ServerLimits:
    """The server's policies against hostile clients (``workbench serve`` flags of the same names)."""

    max_bytes_per_token: int | None = None  # None: the tokenizer's longest token (``TextCodec.max_token_bytes``)
    max_body_bytes: int | None = None  # None: ``default_max_body_bytes``
    header_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    api_key: str | None = None
    api_key_all_routes: bool = False  # also /health and /metrics
    seed: int | None = None  # ``--seed``: request i (in arrival order) that gives no seed samples with seed + i


@dataclass
class ServerState:
    """What the handlers share: the engine loop, the tokenizer (or None), names and limits."""

    engine: AsyncEngine
    codec: Any | None  # workbench.model.tokenizer.TextCodec
    model_name: str
    max_model_len: int
    vocab_size: int
    limits: ServerLimits = field(default_factory=ServerLimits)
    max_bytes_per_token: int = DEFAULT_MAX_BYTES_PER_TOKEN
    draining: bool = False
    created: int = 0
    # parsing and tokenizing, off the event loop; one thread, since a fast tokenizer is not safe to share
    parser: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="parse"))
    num_parsed: int = 0  # requests parsed so far (on the one parser thread): the index of ``limits.seed``'s rule


STATE = web.AppKey("state", ServerState)


def _error(message: str, status: int = 400, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, status, param), status=status)


async def _read_body(request: web.Request, timeout_s: float) -> bytes:
    if request.content_type != "application/json":
        raise ProtocolError(
            f"the request body must be JSON with Content-Type: application/json, got {request.content_type!r}",
            status=415,
        )
    try:
        return await asyncio.wait_for(request.read(), timeout=timeout_s)
    except TimeoutError:
        raise ProtocolError(f"the request body did not arrive within {timeout_s:g} s", status=408) from None


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"the request body is not valid JSON ({exc})") from None
    except RecursionError:
        raise ProtocolError("the request body is not acceptable JSON (nested too deeply)") from None


def _parse(state: ServerState, raw: bytes, chat: bool) -> GenerationRequest:
    """The body -> a request (runs on ``state.parser``, off the event loop)."""
    body = _loads(raw)
    if chat:
        req = parse_chat(body, state.model_name, state.codec, state.max_model_len, state.max_bytes_per_token)
    else:
        req = parse_completion(
            body, state.model_name, state.codec, state.vocab_size, state.max_model_len, state.max_bytes_per_token
        )
    index, state.num_parsed = state.num_parsed, state.num_parsed + 1
    if state.limits.seed is not None and req.sampling.seed is None:  # generate --seed's rule: seed + request index
        req.sampling = replace(req.sampling, seed=(state.limits.seed + index) % SEED_LIMIT)
    return req


class _Completion:
    """Turns a request's outputs into OpenAI completion or chat objects (``chat`` picks the shape)."""

    def __init__(self, state: ServerState, req: GenerationRequest, chat: bool) -> None:
        from workbench.model.tokenizer import IncrementalDetokenizer

        self.req, self.chat, self.model = req, chat, state.model_name
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(unix_time())
        self.detok = IncrementalDetokenizer(state.codec, req.stop) if state.codec is not None else None
        self.token_ids: list[int] = []
        self.text = ""

    def push(self, out: Output) -> str:
        """New text of ``out`` (stop strings applied; empty without a tokenizer)."""
        self.token_ids += out.token_ids
        delta = "" if self.detok is None else self.detok.push(out.token_ids)
        if out.finish_reason is not None and self.detok is not None:
            delta += self.detok.finish()
        self.text += delta
        return delta

    @property
    def stopped(self) -> bool:
        return self.detok is not None and self.detok.stopped

    def usage(self) -> dict[str, int]:
        n_in, n_out = len(self.req.prompt_ids), len(self.token_ids)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    def _choice(self, text: str, finish_reason: str | None, token_ids: list[int], first: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            key = "delta" if self.req.stream else "message"
            msg: dict[str, Any] = {"role": "assistant", "content": text} if (first or not self.req.stream) else {}
            msg.setdefault("content", text)
            choice[key] = msg
        else:
            choice["text"] = text
        choice |= {"logprobs": None, "finish_reason": finish_reason}
        if self.req.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def _object(self, choices: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        obj: dict[str, Any] = {
            "id": self.id,
            "object": kind + (".chunk" if self.chat and self.req.stream else ""),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if not self.req.stream or self.req.include_usage or self.req.continuous_usage:
            obj["usage"] = usage
        if self.req.return_token_ids and not self.req.stream:
            obj["prompt_token_ids"] = self.req.prompt_ids
        return obj

    def full(self, finish_reason: str) -> dict[str, Any]:
        return self._object([self._choice(self.text, finish_reason, self.token_ids, True)], self.usage())

    def chunk(self, text: str, finish_reason: str | None, token_ids: list[int], first: bool) -> dict[str, Any]:
        usage = self.usage() if self.req.continuous_usage else None  # vLLM's continuous_usage_stats
        return self._object([self._choice(text, finish_reason, token_ids, first)], usage)

    def usage_chunk(self) -> dict[str, Any]:
        return self._object([], self.usage())


def _finish_reason(out: Output, comp: _Completion) -> str:
    return "stop" if comp.stopped else ("stop" if out.finish_reason == "stop" else out.finish_reason or "length")


async def _next(handle: RequestHandle) -> Output:
    return await handle.queue.get()


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    received = state.engine.now()  # TTFT and E2E count from here, before the body is read and tokenized
    if state.draining:
        return _error("the server is shutting down", 503)
    try:
        raw = await _read_body(request, state.limits.body_timeout_s)
        req = await asyncio.get_running_loop().run_in_executor(state.parser, _parse, state, raw, chat)
    except ProtocolError as exc:
        return _error(str(exc), exc.status, exc.param)
    except Exception as exc:  # a tokenizer or template failure on this input
        from workbench.errors import WorkbenchError

        if not isinstance(exc, WorkbenchError):
            raise
        return _error(str(exc))
    comp = _Completion(state, req, chat)
    handle = state.engine.add(req.prompt_ids, req.sampling, arrival_time=received)
    try:
        out = await _next(handle)
        if out.finish_reason == "rejected":
            return _error(f"request rejected: {out.error}", 400, "prompt")
        if out.finish_reason == "error":
            return _error(out.error or "engine failure", 500)
        if req.stream:
            return await _stream(request, state, comp, handle, out)
        while True:
            comp.push(out)
            if comp.stopped:
                state.engine.abort(handle, "stop")
                break
            if out.finish_reason is not None:
                break
            out = await _next(handle)
        if out.finish_reason == "error":
            return _error(out.error or "engine failure", 500)
        return web.json_response(comp.full(_finish_reason(out, comp)))
    finally:
        state.engine.abort(handle)  # a no-op when it finished; frees its blocks when the client went away


async def _stream(
    request: web.Request, state: ServerState, comp: _Completion, handle: RequestHandle, out: Output
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        await _write_events(resp, state, comp, handle, out)
    except ConnectionError:  # the client went away mid-stream: the caller's finally aborts the request
        log.info("client disconnected from %s", comp.id)
    return resp


async def _write_events(
    resp: web.StreamResponse, state: ServerState, comp: _Completion, handle: RequestHandle, out: Output
) -> None:
    async def send(obj: dict[str, Any] | str) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        await resp.write(f"data: {data}\n\n".encode())

    first = True
    if comp.chat:  # OpenAI's first chat chunk carries the role
        await send(comp.chunk("", None, [], True))
        first = False
    while True:
        delta = comp.push(out)
        reason = _finish_reason(out, comp) if (out.finish_reason is not None or comp.stopped) else None
        if reason is None and out.finish_reason is None:
            if out.token_ids:  # one chunk per engine step, even when its text is held back or empty (a
                # special token): clients time tokens by chunks
                await send(comp.chunk(delta, None, out.token_ids, first))
                first = False
            out = await _next(handle)
            continue
        if comp.stopped:
            state.engine.abort(handle, "stop")
        if reason == "error":
            await send(error_body(out.error or "engine failure", 500))
        else:
            await send(comp.chunk(delta, reason, out.token_ids, first))
        break
    if comp.req.include_usage:
        await send(comp.usage_chunk())
    await send("[DONE]")
    await resp.write_eof()


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "workbench",
            "root": state.model_name, "max_model_len": state.max_model_len}  # fmt: skip
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=503 if request.app[STATE].draining else 200)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(body=state.engine.metrics.render(), content_type="text/plain", charset="utf-8")


# the connections that have not yet sent a request's headers; their header-timeout timer closes them
_AWAITING_HEADERS: set[Any] = set()


@web.middleware
async def _errors_as_json(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own errors (unknown route, wrong method, body too large) as OpenAI error bodies."""
    _AWAITING_HEADERS.discard(request.protocol)
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.reason or str(exc)
        if exc.status == 413:
            message = f"{exc.text or message}: the body limit is --max-body-bytes"
        return _error(message, exc.status)


@web.middleware
async def _check_api_key(request: web.Request, handler: Any) -> web.StreamResponse:
    """With an API key, a request to a protected route needs ``Authorization: Bearer KEY``."""
    limits = request.app[STATE].limits
    protected = limits.api_key_all_routes or request.path.startswith("/v1")
    if limits.api_key is not None and protected:
        given = request.headers.get("Authorization", "")
        expected = f"Bearer {limits.api_key}"
        if not hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode("utf-8")):
            return _error("a valid API key is required: send the header Authorization: Bearer KEY", 401)
    return await handler(request)


def build_app(
    engine: Engine, codec: Any | None, model_name: str, limits: ServerLimits | None = None
) -> web.Application:
    """The aiohttp application over ``engine``; the engine loop starts and stops with the app."""
    limits = limits or ServerLimits()
    max_len = engine.max_model_len
    bytes_per_token = limits.max_bytes_per_token
    if bytes_per_token is None:
        bytes_per_token = codec.max_token_bytes if codec is not None else DEFAULT_MAX_BYTES_PER_TOKEN
    body_limit = limits.max_body_bytes or default_max_body_bytes(max_len, bytes_per_token)
    app = web.Application(client_max_size=body_limit, middlewares=[_errors_as_json, _check_api_key])
    server_metrics = ServerMetrics(model_name, engine.num_speculative_tokens)  # spec_decode counters when on
    app[STATE] = ServerState(
        AsyncEngine(engine, server_metrics), codec, model_name, max_len, engine.model.config.vocab_size,
        limits=limits, max_bytes_per_token=bytes_per_token, created=int(unix_time()),
    )  # fmt: skip
    log.info("body limit %d bytes, at most %d bytes of text per token", body_limit, bytes_per_token)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)

    async def engine_loop(app: web.Application) -> Any:
        task = asyncio.create_task(app[STATE].engine.run())
        yield
        app[STATE].engine.stop()
        await task
        app[STATE].parser.shutdown(wait=False, cancel_futures=True)

    app.cleanup_ctx.append(engine_loop)
    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, made before the model loads so that a busy port or a bad host fails
    at once; ``OSError`` when it cannot be bound."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    sock = socket.create_server(address[:2] if family == socket.AF_INET else address, family=family)
    sock.setblocking(False)
    return sock


class _TimedSockSite(web.SockSite):
    """A site on a bound socket that closes a connection which has not sent a request's headers in time."""

    def __init__(self, runner: web.AppRunner, sock: socket.socket, header_timeout_s: float) -> None:
        super().__init__(runner, sock)
        self._header_timeout_s = header_timeout_s

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        factory = self._runner.server

        def close_if_silent(proto: Any) -> None:
            if proto in _AWAITING_HEADERS:
                _AWAITING_HEADERS.discard(proto)
                proto.force_close()

        def make() -> Any:
            proto = factory()
            _AWAITING_HEADERS.add(proto)
            loop.call_later(self._header_timeout_s, close_if_silent, proto)
            return proto

        self._server = await loop.create_server(make, sock=self._sock, backlog=self._backlog)


async def serve(
    app: web.Application,
    host: str,
    port: int,
    drain_timeout_s: float = 30.0,
    sock: socket.socket | None = None,
) -> None:
    """Serve on ``sock`` (or a socket bound to ``host:port``) until SIGTERM/SIGINT, then drain: stop admitting, wait
    for in-flight requests, abort the rest."""
    sock = sock or bind(host, port)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = _TimedSockSite(runner, sock, app[STATE].limits.header_timeout_s)
    await site.start()
    bound = sock.getsockname()[1]
    print(json.dumps({"event": "listening", "host": host, "port": bound}), flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    state = app[STATE]
    state.draining = True
    deadline = loop.time() + drain_timeout_s
    while state.engine.num_in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    left = state.engine.num_in_flight
    state.engine.stop()  # the loop aborts what is left, so that those handlers end their responses
    await asyncio.wait_for(state.engine.done.wait(), timeout=30.0)
    print(json.dumps({"event": "shutdown", "aborted": left}), flush=True)
    await runner.cleanup()
