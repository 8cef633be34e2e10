"""A table of malformed and hostile requests: each gets a clear error, and the engine keeps serving."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from client import Client
from protocol.messages import ClientReply, FinishReason, GenerateOutput
from protocol.transport import Codec, make_socket
from tests.tokenizer_proc.http.server import HttpEngine, wait_idle_and_free

OK = {"prompt": "Hello", "max_tokens": 2}
MSG = [{"role": "user", "content": "hi"}]

# (name, path, body: a JSON-able value or raw bytes, expected status, the "param" the error must name)


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nonsense"}}}  # xgrammar: Unsupported type
BAD_SCHEMA_TOOL = {"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}

HTTP_CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("max_tokens as a string", "completions", {**OK, "max_tokens": "5"}, 400, "max_tokens"),
    ("negative max_tokens", "completions", {**OK, "max_tokens": -1}, 400, "max_tokens"),
    ("zero max_tokens", "completions", {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens beyond 64 bits", "completions", {**OK, "max_tokens": 10**30}, 400, "max_tokens"),
    ("NaN temperature", "completions", b'{"prompt": "x", "temperature": NaN}', 400, None),
    ("infinite temperature", "completions", b'{"prompt": "x", "temperature": 1e999}', 400, "temperature"),
    ("negative temperature", "completions", {**OK, "temperature": -0.5}, 400, "temperature"),
    ("top_p zero", "completions", {**OK, "top_p": 0}, 400, "top_p"),
    ("top_p above one", "completions", {**OK, "top_p": 2.5}, 400, "top_p"),
    ("top_k below -1", "completions", {**OK, "top_k": -5}, 400, "top_k"),
    ("min_p above one", "completions", {**OK, "min_p": 1.5}, 400, "min_p"),
    ("negative seed", "completions", {**OK, "seed": -1}, 400, "seed"),
    ("seed beyond 64 bits", "completions", {**OK, "seed": 2**64}, 400, "seed"),
    ("empty prompt", "completions", {**OK, "prompt": ""}, 400, "prompt"),
    ("empty prompt list", "completions", {**OK, "prompt": []}, 400, "prompt"),
    ("prompt beyond the context", "completions", {**OK, "prompt": "word " * 3000}, 400, "prompt"),
    ("token id outside the vocab", "completions", {**OK, "prompt": [5, 99_999_999]}, 400, "prompt"),
    ("a batch mixing texts and ids", "completions", {**OK, "prompt": ["a", [5]]}, 400, "prompt"),
    ("a bad prompt in a batch", "completions", {**OK, "prompt": [[5], [5, 99_999_999]]}, 400, "prompt"),
    ("prompt is a number", "completions", {**OK, "prompt": 123}, 400, "prompt"),
    ("invalid UTF-8", "completions", b'{"prompt": "\xff\xfe\xfd"}', 400, None),
    ("unknown field", "completions", {**OK, "temprature": 0.5}, 400, "temprature"),
    ("body is an array", "completions", [1, 2, 3], 400, None),
    ("empty body", "completions", b"", 400, None),
    ("truncated JSON", "completions", b'{"prompt": "abc', 400, None),
    ("n above the limit", "completions", {**OK, "n": 129}, 400, "n"),
    ("empty stop string", "completions", {**OK, "stop": [""]}, 400, "stop"),
    ("too many stop strings", "completions", {**OK, "stop": [str(i) for i in range(40)]}, 400, "stop"),
    ("negative stop token id", "completions", {**OK, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("top-21 logprobs", "completions", {**OK, "logprobs": 21}, 400, "logprobs"),
    ("negative logprobs", "completions", {**OK, "logprobs": -1}, 400, "logprobs"),
    (
        "top-21 chat logprobs",
        "chat/completions",
        {"messages": MSG, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    (
        "top_logprobs without logprobs",
        "chat/completions",
        {"messages": MSG, "top_logprobs": 1},
        400,
        "top_logprobs",
    ),
    ("echo on chat", "chat/completions", {"messages": MSG, "echo": True}, 400, "echo"),
    ("presence_penalty above 2", "completions", {**OK, "presence_penalty": 2.5}, 400, "presence_penalty"),
    (
        "frequency_penalty below -2",
        "chat/completions",
        {"messages": MSG, "frequency_penalty": -3},
        400,
        "frequency_penalty",
    ),
    ("repetition_penalty zero", "completions", {**OK, "repetition_penalty": 0}, 400, "repetition_penalty"),
    (
        "repetition_penalty 1e300",
        "completions",
        {**OK, "repetition_penalty": 1e300},
        400,
        "repetition_penalty",
    ),
    ("temperature 1e300", "completions", {**OK, "temperature": 1e300}, 400, "temperature"),
    ("logit_bias id outside the vocab", "completions", {**OK, "logit_bias": {"49152": 1}}, 400, "logit_bias"),
    (
        "logit_bias key not an id",
        "chat/completions",
        {"messages": MSG, "logit_bias": {"hi": 1}},
        400,
        "logit_bias",
    ),
    ("logit_bias value above 100", "completions", {**OK, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    (
        "301 logit_bias entries",
        "completions",
        {**OK, "logit_bias": {str(i): 1 for i in range(301)}},
        400,
        "logit_bias",
    ),
    ("min_tokens above max_tokens", "completions", {**OK, "min_tokens": 3}, 400, "min_tokens"),
    ("negative min_tokens", "chat/completions", {"messages": MSG, "min_tokens": -1}, 400, "min_tokens"),
    (
        "stream_options without stream",
        "completions",
        {**OK, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),  # fmt: skip
    ("unknown model", "completions", {**OK, "model": "gpt-9"}, 404, "model"),
    ("body over 8 MiB", "completions", b'{"prompt": "' + b"a" * (9 * 2**20) + b'"}', 413, None),
    ("no messages", "chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("empty messages", "chat/completions", {"messages": [], "max_tokens": 2}, 400, "messages"),
    (
        "unknown role",
        "chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages[0].role",
    ),  # fmt: skip
    (
        "image content part",
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content[0]",
    ),  # fmt: skip
    (
        "message content is a number",
        "chat/completions",
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content",
    ),  # fmt: skip
    ("tool without function", "chat/completions", {"messages": MSG, "tools": [{"type": "function"}]}, 400,
     "tools[0].function"),
    ("tool with a bad name", "chat/completions", {"messages": MSG, "tools": [_tool("no spaces")]}, 400,
     "tools[0].function.name"),
    ("tool_choice names no tool", "chat/completions",
     {"messages": MSG, "tools": [_tool("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     400, "tool_choice"),
    ("tool_choice unknown word", "chat/completions",
     {"messages": MSG, "tools": [_tool("f")], "tool_choice": "any"}, 400, "tool_choice"),
    ("tool_choice required without tools", "chat/completions", {"messages": MSG, "tool_choice": "required"},
     400, "tool_choice"),
    ("tool message without tool_call_id", "chat/completions",
     {"messages": [*MSG, {"role": "tool", "content": "42"}]}, 400, "messages[1].tool_call_id"),
    ("chat_template_kwargs overriding tools", "chat/completions",
     {"messages": MSG, "chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs"),
    *[(f"tool schema that does not compile, tool_choice {choice}", "chat/completions",
       {"messages": MSG, "tools": [_tool("g"), BAD_SCHEMA_TOOL], "tool_choice": choice}, 400,
       "tools[1].function.parameters")
      for choice in ("auto", "none", "required", {"type": "function", "function": {"name": "f"}})],
    ("max_tokens beyond the context", "completions", {**OK, "max_tokens": 10**9}, 400, "max_tokens"),
    ("max_tokens that the prompt leaves no room for", "completions", {"prompt": [5] * 1000, "max_tokens": 25},
     400, "max_tokens"),
    ("max_completion_tokens beyond the context", "chat/completions",
     {"messages": MSG, "max_completion_tokens": 10**9}, 400, "max_completion_tokens"),
    ("chat's legacy max_tokens beyond the context", "chat/completions",
     {"messages": MSG, "max_tokens": 10**9}, 400, "max_tokens"),
    ("user content null", "chat/completions", {"messages": [{"role": "user", "content": None}]}, 400,
     "messages[0].content"),
    ("system content null", "chat/completions",
     {"messages": [{"role": "system", "content": None}, *MSG]}, 400, "messages[0].content"),
    ("lone high surrogate escape", "completions", b'{"prompt": "\\ud800"}', 400, None),
    ("lone low surrogate escape", "chat/completions",
     b'{"messages": [{"role": "user", "content": "a\\udc00b"}]}', 400, None),
    ("JSON nested past the decoder's depth", "chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": '
     + b"[" * 100_000 + b"]" * 100_000 + b"}}", 400, None),
]  # fmt: skip


def _post(engine: HttpEngine, path: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else msgspec.json.encode(body)
    headers = {"content-type": "application/json"}
    return httpx.post(f"{engine.v1}/{path}", content=content, headers=headers, timeout=30)


def _still_serving(engine: HttpEngine) -> None:
    reply = _post(engine, "completions", {**OK, "model": "tiny"})
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "param"), HTTP_CASES, ids=[c[0] for c in HTTP_CASES]
)
def test_bad_http_request(
    engine: HttpEngine, name: str, path: str, body: Any, status: int, param: str | None
) -> None:
    reply = _post(engine, path, body)
    error = reply.json()["error"]
    assert (reply.status_code, error["param"]) == (status, param), error
    assert error["message"] and error["type"]
    _still_serving(engine)


def _raw_http(engine: HttpEngine, data: bytes) -> bytes:
    """Send raw bytes, half-close, and read whatever comes back; a hang fails the test."""
    host, port = engine.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


RAW_CASES = [
    (
        "body shorter than its Content-Length",
        b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt"',
    ),  # fmt: skip
    ("garbage request line", b"\x16\x03\x01 not http at all\r\n\r\n"),
    ("GET on a POST route", b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n"),
]


@pytest.mark.parametrize(("name", "data"), RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_broken_http_is_refused_or_closed(engine: HttpEngine, name: str, data: bytes) -> None:
    answer = _raw_http(engine, data)
    # A 4xx, or a closed connection when there is no request to answer; never a hang or a 2xx/5xx.
    assert answer == b"" or answer.split(b" ", 2)[1].startswith(b"4"), answer[:200]
    _still_serving(engine)


def _zmq_exchange(engine: HttpEngine, frames: list[bytes]) -> GenerateOutput:
    ctx = zmq.Context()
    try:
        sock = make_socket(ctx, zmq.DEALER, engine.engine.endpoint, bind=False)
        sock.send_multipart(frames)
        assert sock.poll(10_000), "no reply to a malformed frame"
        return Codec[ClientReply](ClientReply).decode(sock.recv())
    finally:
        ctx.destroy(linger=0)


def _map(**fields: Any) -> bytes:
    return msgspec.msgpack.encode({"type": "generate", "rid": "r1", **fields})


PLACEHOLDER = "PLACEHOLDER"


def _with_invalid_utf8(frame: bytes) -> bytes:
    """``frame`` with its PLACEHOLDER string's bytes made invalid UTF-8 (msgspec writes none)."""
    return frame.replace(msgspec.msgpack.encode(PLACEHOLDER), b"\xa2\xff\xfe")


ZMQ_CASES: list[tuple[str, list[bytes], str]] = [
    ("garbage bytes", [b"\xc1\xc1 definitely not msgpack"], "malformed"),
    ("msgpack array, not a map", [msgspec.msgpack.encode([1, 2, 3])], "malformed"),
    ("unknown message tag", [msgspec.msgpack.encode({"type": "shutdown_everything"})], "malformed"),
    ("two frames", [b"a", b"b"], "single frame"),
    ("NaN temperature", [_map(prompt="x", sampling={"temperature": float("nan")})], "sampling.temperature"),
    ("prompt beyond the context", [_map(input_ids=[7] * 5000)], "context length"),
    ("unknown field", [_map(prompt="x", priority=9)], "malformed"),
    ("a bare string of invalid UTF-8", [bytes.fromhex("a1ff")], "malformed"),
    ("a rid of invalid UTF-8", [bytes.fromhex("82a474797065a867656e6572617465a3726964a1ff")], "at `$.rid`"),
    ("a prompt of invalid UTF-8", [_with_invalid_utf8(_map(prompt=PLACEHOLDER))], "at `$.prompt`"),
    (
        "a stop string of invalid UTF-8",
        [_with_invalid_utf8(_map(prompt="x", sampling={"stop": [PLACEHOLDER]}))],
        "at `$.sampling.stop[0]`",
    ),
    ("nesting past the decoder's depth",
     [_map(prompt="x", chat_template_kwargs={"a": 0})[:-1] + b"\x91" * 100_000 + b"\x01"], "malformed"),
    ("tool parameters that are not JSON", [_map(messages=MSG, tools=[{"function": {"name": "f", "parameters":
     {"type": "object", "default": b"\x00"}}}])], "tools[0].function.parameters is not JSON"),
    ("a tool schema that does not compile", [_map(messages=MSG, tools=[BAD_SCHEMA_TOOL])],
     "tools[0].function.parameters cannot be compiled"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "frames", "says"), ZMQ_CASES, ids=[c[0] for c in ZMQ_CASES])
def test_bad_zmq_frame(engine: HttpEngine, name: str, frames: list[bytes], says: str) -> None:
    reply = _zmq_exchange(engine, frames)
    assert reply.finish_reason is FinishReason.ERROR and reply.error and says in reply.error, reply
    with Client(engine.engine.endpoint, timeout_s=30) as c:
        assert c.generate("Hello", max_new_tokens=2).finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


EXTREME_IN_RANGE = [
    {"temperature": 1e-300},  # greedy: 1/temperature would overflow float32
    {"temperature": 1.0, "top_p": 1e-300},  # rounds to 0 in float32: the likeliest token stays
    {"temperature": 1e6},
    {"repetition_penalty": 1e-6},
    {"repetition_penalty": 1e6},
]


def test_extreme_values_in_range_are_served_alongside_others(engine: HttpEngine) -> None:
    """Extreme but accepted sampling values run in one batch with a plain request and fail none of
    them (1e300 as repetition_penalty once failed the forward step, and every row in it); the two
    that leave only the likeliest token give the greedy text."""
    base = {"prompt": "The sky is", "max_tokens": 4, "ignore_eos": True}
    greedy = _post(engine, "completions", {**base, "temperature": 0}).json()["choices"][0]["text"]
    with ThreadPoolExecutor(len(EXTREME_IN_RANGE) + 1) as pool:
        bodies = [{**base, **extra} for extra in EXTREME_IN_RANGE] + [{**base, "temperature": 0}]
        replies = list(pool.map(lambda body: _post(engine, "completions", body), bodies))
    for body, reply in zip(bodies, replies, strict=True):
        assert reply.status_code == 200, (body, reply.text)
        assert reply.json()["usage"]["completion_tokens"] == 4, (body, reply.text)
    texts = [reply.json()["choices"][0]["text"] for reply in replies]
    assert texts[0] == texts[1] == texts[-1] == greedy, texts


def test_a_top_k_past_int64_is_the_whole_vocabulary(engine: HttpEngine) -> None:
    """msgpack carries ints up to 2**64 - 1, past the worker's int64 top_k table: such a top_k keeps
    every token, as any top_k of at least the vocabulary does (once it failed the forward step)."""
    with Client(engine.engine.endpoint, timeout_s=30) as c:
        reply = c.generate("The sky is", max_new_tokens=3, top_k=2**64 - 1, seed=1, ignore_eos=True)
        assert (reply.finish_reason, reply.error, len(reply.token_ids)) == (FinishReason.LENGTH, None, 3)
        same = c.generate("The sky is", max_new_tokens=3, top_k=-1, seed=1, ignore_eos=True)
    assert reply.token_ids == same.token_ids


def test_a_limit_beyond_the_context_is_context_length_exceeded(engine: HttpEngine) -> None:
    """A max_tokens the client set that cannot fit beside the prompt is refused, as OpenAI and vLLM
    do; one that fits exactly runs, and an absent one is still lowered to fit."""
    for path, body in [
        ("completions", {"prompt": [5] * 1000, "max_tokens": 25}),
        ("chat/completions", {"messages": MSG, "max_completion_tokens": 10**9}),
    ]:
        reply = _post(engine, path, body)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded", (
            reply.text
        )
    exact = _post(engine, "completions", {"prompt": [5] * 1000, "max_tokens": 24, "ignore_eos": True})
    assert exact.status_code == 200 and exact.json()["usage"]["completion_tokens"] == 24, exact.text
    default = _post(engine, "completions", {"prompt": [5] * 1020, "ignore_eos": True})  # 16, lowered to 4
    assert default.status_code == 200 and default.json()["usage"]["completion_tokens"] == 4, default.text


def test_nothing_leaked_after_the_bad_inputs(engine: HttpEngine) -> None:
    m = wait_idle_and_free(engine.base_url)
    assert m['rivulet_requests_finished_total{finish_reason="error"}'] == 0  # rejected before admission
