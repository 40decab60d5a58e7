"""The OpenAI request bodies the server accepts, checked field by field, and its error bodies.

``parse_completion`` and ``parse_chat`` turn a decoded JSON body into a ``GenerationRequest`` (prompt ids, the
engine's ``SamplingParams``, stop strings, streaming options) or raise ``ProtocolError`` with the HTTP status, the
message and the offending field, which ``error_body`` writes the way OpenAI does:
``{"error": {"message", "type", "param", "code"}}``.

Accepted fields: OpenAI's, plus vLLM's extensions that benchmark clients send (``top_k``, ``ignore_eos``,
``min_tokens``, ``repetition_penalty``, ``min_p``, ``return_token_ids``, ``stream_options.continuous_usage_stats``).
Fields this engine does not implement (``n``, ``best_of``, ``logprobs``, ``echo``, penalties, ``logit_bias``,
``suffix``) are accepted only at their no-op value; any other value, and any unknown field, is a 400 naming it.
Defaults follow OpenAI: temperature 1, ``max_tokens`` 16 for completions and the rest of the context for chat.
Prompt ids and lengths go through ``workbench.request.validate_request``, the rule of every entry point (vLLM's: a
prompt + ``max_tokens`` beyond ``max_model_len`` is refused, a 400 here, never capped).

Pure Python (no torch, no aiohttp): the tokenizer is passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from workbench.errors import RequestError, WorkbenchError
from workbench.request import SamplingParams, default_max_tokens, validate_request

# field -> the values at which an unimplemented feature is a no-op
_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "stream",
           "stream_options", "user", "return_token_ids"} | set(_NO_OP_VALUES)  # fmt: skip
COMPLETION_FIELDS = _COMMON | {"prompt"}
# bytes of text one token covers at most, when the tokenizer does not say (``max_token_bytes`` measures it)
DEFAULT_MAX_BYTES_PER_TOKEN = 64
CHAT_FIELDS = (_COMMON | {"messages", "max_completion_tokens"}) - {"echo", "suffix", "best_of"}


class ProtocolError(WorkbenchError):
    """A request the server refuses: HTTP ``status``, a message naming the problem, and the field (``param``)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def error_type(status: int) -> str:
    """OpenAI's ``type`` for an HTTP status: every 4xx is the client's error, every 5xx the server's."""
    special = {401: "authentication_error", 404: "not_found_error", 503: "service_unavailable"}
    if status in special:
        return special[status]
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


def error_body(message: str, status: int = 400, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    kind = error_type(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@dataclass
class GenerationRequest:
    """One request, as the engine and the streamer need it."""

    prompt_ids: list[int]
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage in every chunk
    return_token_ids: bool = False
    prompt_text: str | None = None


def _check_fields(body: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ProtocolError(f"unknown field(s) {', '.join(unknown)}", param=unknown[0])
    for name, ok in _NO_OP_VALUES.items():
        if name in body and body[name] not in ok:
            raise ProtocolError(
                f"{name}={body[name]!r} is not supported by this server (accepted: {ok[1]!r} or absent)", param=name
            )
    return body


def _check_model(body: dict[str, Any], served_model: str) -> None:
    model = body.get("model")
    if model is not None and model != served_model:
        raise ProtocolError(f"the model {model!r} does not exist; this server serves {served_model!r}", "model", 404)


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ProtocolError(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProtocolError(f"{name} must be a finite number, got {value!r}", param=name)
    return float(value)


def _int(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{name} must be an integer, got {value!r}", param=name)
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ProtocolError(f"stop must be a non-empty string or a list of them, got {stop!r}", param="stop")
    return stops


def _sampling(
    body: dict[str, Any], max_tokens: int | None, prompt_ids: list[int], max_model_len: int, vocab_size: int | None
) -> SamplingParams:
    if max_tokens is None:  # chat: the rest of the context
        max_tokens = default_max_tokens(len(prompt_ids), max_model_len)
    if max_tokens < 1:
        raise ProtocolError(f"max_tokens must be an integer >= 1, got {max_tokens}", param="max_tokens")
    try:
        validate_request(prompt_ids, max_tokens, max_model_len, vocab_size)  # the one rule of every entry point
    except RequestError as exc:
        raise ProtocolError(str(exc), param=exc.param) from None
    top_k = _int(body, "top_k", 0)
    try:
        return SamplingParams(
            temperature=_number(body, "temperature", 1.0),
            top_p=_number(body, "top_p", 1.0),
            top_k=0 if top_k == -1 else top_k,  # vLLM's -1 = off
            max_tokens=max_tokens,
            ignore_eos=_bool(body, "ignore_eos"),
            seed=_int(body, "seed", None),
        )
    except RequestError as exc:
        raise ProtocolError(str(exc), param=str(exc).split(" ", 1)[0]) from None


def _stream_options(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of ``stream_options``."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise ProtocolError("stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise ProtocolError(
            f"stream_options accepts include_usage and continuous_usage_stats, got {options!r}", param="stream_options"
        )
    try:
        return _bool(options, "include_usage"), _bool(options, "continuous_usage_stats")
    except ProtocolError as exc:
        raise ProtocolError(str(exc), param="stream_options") from None


def _finish(
    body: dict[str, Any],
    prompt_ids: list[int],
    max_tokens: int | None,
    max_model_len: int,
    text: str | None,
    vocab_size: int | None = None,
):  # noqa: ANN202
    stream = _bool(body, "stream")
    include_usage, continuous_usage = _stream_options(body, stream)
    return GenerationRequest(
        prompt_ids=prompt_ids,
        sampling=_sampling(body, max_tokens, prompt_ids, max_model_len, vocab_size),
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        return_token_ids=_bool(body, "return_token_ids"),
        prompt_text=text,
    )


def _utf8_len(text: str, what: str, param: str) -> int:
    """The UTF-8 length of ``text``; a 400 for a string JSON can carry but UTF-8 cannot (a lone surrogate)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ProtocolError(
            f"{what} is not valid Unicode text ({exc.reason} at position {exc.start}): send UTF-8 text without lone "
            "surrogates",
            param=param,
        ) from None


def check_text_fits(num_bytes: int, max_model_len: int, max_bytes_per_token: int, param: str) -> None:
    """A 400, before tokenizing, for text that cannot fit ``max_model_len`` tokens: no token of the vocabulary
    covers more than ``max_bytes_per_token`` bytes, so such text has more tokens than the context holds."""
    limit = max_model_len * max_bytes_per_token
    if num_bytes > limit:
        raise ProtocolError(
            f"the prompt text has {num_bytes} bytes; this model's maximum context length is {max_model_len} tokens "
            f"and no token covers more than {max_bytes_per_token} bytes, so at most {limit} bytes can fit",
            param=param,
        )


def _token_ids(value: list[Any]) -> list[int]:
    if not value:
        raise ProtocolError("prompt is empty: give text or at least one token id", param="prompt")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ProtocolError("a prompt given as a list must hold token ids (integers)", param="prompt")
    return list(value)  # the vocabulary is checked with the rest of the request (validate_request)


def parse_completion(
    body: Any,
    served_model: str,
    codec: Any | None,
    vocab_size: int,
    max_model_len: int,
    max_bytes_per_token: int = DEFAULT_MAX_BYTES_PER_TOKEN,
) -> GenerationRequest:
    """A ``/v1/completions`` body: ``prompt`` is a string, a list of token ids, or a one-element list of either.

    A text prompt longer than ``max_model_len * max_bytes_per_token`` bytes is refused before it is tokenized."""
    body = _check_fields(body, COMPLETION_FIELDS)
    _check_model(body, served_model)
    if "prompt" not in body:
        raise ProtocolError("prompt is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ProtocolError("this server takes one prompt per request (got a batch of prompts)", param="prompt")
    text = None
    if isinstance(prompt, str):
        if codec is None:
            raise ProtocolError(
                "this model has no tokenizer, so a text prompt cannot be encoded: give the prompt as a list of "
                "token ids",
                param="prompt",
            )
        if prompt == "":
            raise ProtocolError("prompt is empty: give text or at least one token id", param="prompt")
        check_text_fits(_utf8_len(prompt, "prompt", "prompt"), max_model_len, max_bytes_per_token, "prompt")
        text, prompt_ids = prompt, codec.encode(prompt)
    elif isinstance(prompt, list):
        prompt_ids = _token_ids(prompt)
    else:
        raise ProtocolError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", "prompt")
    return _finish(body, prompt_ids, _int(body, "max_tokens", 16), max_model_len, text, vocab_size)


def _message_text(message: Any, i: int) -> dict[str, str]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ProtocolError(f"messages[{i}] must be an object with a role and a content", param="messages")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ProtocolError(f"messages[{i}].content: only text parts are supported", param="messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ProtocolError(f"messages[{i}].content must be a string, got {content!r}", param="messages")
    return {"role": message["role"], "content": content}


def parse_chat(
    body: Any,
    served_model: str,
    codec: Any | None,
    max_model_len: int,
    max_bytes_per_token: int = DEFAULT_MAX_BYTES_PER_TOKEN,
) -> GenerationRequest:
    """A ``/v1/chat/completions`` body, rendered by the tokenizer's chat template.

    Messages whose roles and contents together exceed ``max_model_len * max_bytes_per_token`` bytes are refused
    before the template renders them."""
    body = _check_fields(body, CHAT_FIELDS)
    _check_model(body, served_model)
    if codec is None or not codec.has_chat_template:
        what = "no tokenizer" if codec is None else "a tokenizer without a chat template"
        raise ProtocolError(f"this model has {what}, so it cannot serve chat completions; use /v1/completions")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages must be a non-empty list", param="messages")
    chat = [_message_text(m, i) for i, m in enumerate(messages)]
    num_bytes = sum(
        _utf8_len(m["role"], f"messages[{i}].role", "messages")
        + _utf8_len(m["content"], f"messages[{i}].content", "messages")
        for i, m in enumerate(chat)
    )
    check_text_fits(num_bytes, max_model_len, max_bytes_per_token, "messages")
    max_tokens = _int(body, "max_completion_tokens", None)
    max_tokens = _int(body, "max_tokens", None) if max_tokens is None else max_tokens
    return _finish(body, codec.encode_chat(chat), max_tokens, max_model_len, None)
