"""What the sync and async clients share: the default endpoint, errors, request building."""

from __future__ import annotations

import base64
import os
import uuid
from typing import Any, TypedDict

import msgspec
import zmq

from protocol.chat import Tool, ToolChoice
from protocol.grammar import Grammar
from protocol.messages import ChatMessage, FinishReason, GenerateOutput, GenerateRequest, SamplingParams
from protocol.transport import HEARTBEAT_SOCKET_OPTIONS

# Where the launcher binds the client socket unless told otherwise.
DEFAULT_ENDPOINT = "ipc:///tmp/rivulet/client.sock"
ENDPOINT_ENV = "RIVULET_ENDPOINT"
LOST_CONNECTION = "lost the connection to the engine"
# How long a request waits for an engine to answer at all: ZMQ's handshake, which a live engine's
# I/O thread completes in milliseconds however busy the engine is. Past it, with no handshake,
# nothing is listening; once one succeeded, a reply may take the whole timeout_s (a long prefill).
CONNECT_TIMEOUT_S = 5.0


class EngineError(RuntimeError):
    """The engine rejected or failed a request; the message is the engine's reason."""


class EngineUnreachable(ConnectionError):
    """No engine answered at the client's endpoint within its connect timeout."""


def nothing_listening(endpoint: str, waited_s: float) -> EngineUnreachable:
    return EngineUnreachable(
        f"nothing is listening at {endpoint}: no engine answered within {waited_s:g} s "
        "(is the launcher running, with this --endpoint?)"
    )


def connect_dealer(ctx: zmq.Context, endpoint: str) -> tuple[zmq.Socket, zmq.Socket]:
    """The client's DEALER and a monitor socket that reports when an engine answered (the
    handshake succeeded) and when the connection drops.

    A connection whose heartbeats stop is dropped, which the monitor reports.
    """
    sock = ctx.socket(zmq.DEALER)
    for option, value in HEARTBEAT_SOCKET_OPTIONS:
        sock.setsockopt(option, value)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    sock.connect(endpoint)
    return sock, monitor


def default_endpoint() -> str:
    """``$RIVULET_ENDPOINT`` if set, else the launcher's default endpoint."""
    return os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT


class GenerateOptions(TypedDict, total=False):
    """Keyword arguments of ``generate`` besides the prompt and ``stream``; unset ones take
    SamplingParams' defaults, so the defaults live in one place (protocol/)."""

    messages: list[dict[str, Any]] | None  # OpenAI's chat messages, tool_calls and tool results included
    input_ids: list[int] | None
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None
    stop: list[str] | None
    stop_token_ids: list[int] | None
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int  # with logprobs: also the N (<= 20) likeliest tokens at each position
    echo: bool  # the reply carries the prompt too (with logprobs: every prompt token's logprob)
    rid: str | None
    cache_salt: str | None  # prefix-cache namespace: requests share cached KV only within one
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: dict[int, float] | None  # token id -> added logit
    min_tokens: int
    # Chat (messages) only, as in OpenAI's API: the reply's tool_calls and reasoning_text are parsed out.
    tools: list[dict[str, Any]] | None  # [{"type": "function", "function": {"name", "parameters", ...}}]
    tool_choice: str | dict[str, Any]  # "auto" (default), "none", "required", or {"type": "function", ...}
    parallel_tool_calls: bool  # False: the reply keeps only its first tool call
    # extra chat template variables, e.g. {"enable_thinking": False}
    chat_template_kwargs: dict[str, Any] | None
    n: int  # choices from one prefill (choice i samples with seed + i); replies carry ``index``
    # Constrained output: Grammar(kind="json_schema", spec=json.dumps(schema)), "json_object",
    # "regex" (spec: the pattern) or "ebnf" (spec: the grammar, start rule ``root``).
    grammar: Grammar | None
    # An embedding: the reply's ``embedding`` is the prompt pooled and normalized; nothing is
    # generated (max_new_tokens defaults to 0 then).
    embed: bool


SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)


def make_request(prompt: str | None, stream: bool, options: GenerateOptions) -> GenerateRequest:
    """A GenerateRequest with a fresh rid unless one is given. The engine validates the values."""
    sampling = {k: v for k, v in options.items() if k in SAMPLING_FIELDS and v is not None}
    if options.get("embed"):
        sampling.setdefault("max_new_tokens", 0)
    messages = options.get("messages")
    rid = options.get("rid")
    tools = options.get("tools")
    return GenerateRequest(
        rid=rid if rid is not None else uuid.uuid4().hex,
        prompt=prompt,
        messages=msgspec.convert([_with_parts(m) for m in messages], list[ChatMessage])
        if messages is not None
        else None,
        input_ids=options.get("input_ids"),
        cache_salt=options.get("cache_salt"),
        sampling=msgspec.convert(sampling, SamplingParams),
        stream=stream,
        logprobs=options.get("logprobs", False),
        top_logprobs=options.get("top_logprobs", 0),
        echo=options.get("echo", False),
        tools=msgspec.convert(tools, list[Tool]) if tools is not None else None,
        tool_choice=msgspec.convert(options.get("tool_choice", "auto"), ToolChoice),
        parallel_tool_calls=options.get("parallel_tool_calls", True),
        chat_template_kwargs=options.get("chat_template_kwargs"),
        n=options.get("n", 1),
        embed=options.get("embed", False),
    )


class ChoiceCount:
    """How many choices of each in-flight request are still to finish (a request ends with its
    last choice, or at once with an error reply)."""

    def __init__(self) -> None:
        self._left: dict[str, int] = {}

    def start(self, req: GenerateRequest) -> None:
        self._left[req.rid] = req.n

    def finished(self, reply: GenerateOutput) -> bool:
        """Count ``reply``, a final one; True when its request has no choice left."""
        left = self._left.get(reply.rid, 1) - 1
        if left <= 0 or reply.finish_reason is FinishReason.ERROR:
            self._left.pop(reply.rid, None)
            return True
        self._left[reply.rid] = left
        return False

    def forget(self, rid: str) -> None:
        self._left.pop(rid, None)


def single_choice(req: GenerateRequest) -> None:
    if req.n != 1:
        raise ValueError("generate(stream=False) returns one reply: use generate_choices for n > 1")


def embed_input(prompt: str | list[int]) -> tuple[str | None, list[int] | None]:
    """``embed``'s one input as ``generate``'s ``prompt`` or ``input_ids``."""
    return (prompt, None) if isinstance(prompt, str) else (None, list(prompt))


def embedding_of(reply: GenerateOutput) -> list[float]:
    """The vector of an embed request's final reply (error replies raised before this)."""
    if reply.embedding is None:
        raise EngineError("the engine's final reply to an embed request carries no embedding")
    return reply.embedding


def check_reply(reply: GenerateOutput) -> GenerateOutput:
    """Raise EngineError for an error reply; pass any other reply through."""
    if reply.finish_reason is FinishReason.ERROR:
        raise EngineError(reply.error or "the engine failed the request without a reason")
    return reply


def _with_parts(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-style message whose content is a list of parts (text, and images as ``image_url``
    data URIs, or ``{"type": "image", "data": <file bytes>}``) as the engine's ``parts``."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    parts = []
    for part in content:
        url = (part.get("image_url") or {}).get("url", "") if part.get("type") == "image_url" else ""
        if url.startswith("data:") and "," in url:
            parts.append({"type": "image", "data": base64.b64decode(url.partition(",")[2])})
        elif url:
            parts.append({"type": "image", "path": url.removeprefix("file://")})
        else:
            parts.append(part)
    return {**{k: v for k, v in message.items() if k != "content"}, "parts": parts}
