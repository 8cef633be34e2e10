"""``parallel_tool_calls: false`` on a real engine (the package's tiny Llama): a reply that writes
two calls keeps only the first. A random model writes no calls of its own, so a regex (SGLang's
extension) makes it write exactly two Hermes-style calls; chat (whole and streamed) and the ZMQ
client go through the same tokenizer parsing as the Responses API (whose mapping of the field
test_responses_items checks)."""

from __future__ import annotations

import json
import re
from typing import Any

import openai
import pytest

from client import Client, Grammar
from tests.tokenizer_proc.http.server import HttpEngine

ADD: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS: Any = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
CALLS = [{"name": "add", "arguments": {"a": 2}}, {"name": "add", "arguments": {"a": 3}}]
TWO_CALLS = "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in CALLS)
PATTERN = re.sub(r"([{}\[\]().*+?|^$\\])", r"\\\1", TWO_CALLS)  # the exact text, as a regex
MESSAGES: Any = [{"role": "user", "content": "Add 2, then add 3."}]


def _chat(oai: openai.OpenAI, parallel: bool | None, stream: bool) -> tuple[list[tuple[str, str]], str]:
    """The reply's calls as (name, arguments), and its finish_reason."""
    kw: Any = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 80, "temperature": 0}
    kw["extra_body"] = {"regex": PATTERN}
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    if not stream:
        choice = oai.chat.completions.create(**kw).choices[0]
        calls = choice.message.tool_calls or []
        return [(c.function.name, c.function.arguments) for c in calls], choice.finish_reason  # type: ignore[union-attr]
    pieces: dict[int, list[str]] = {}
    finish = ""
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                name = piece.function.name if piece.function and piece.function.name else None
                pieces.setdefault(piece.index, [name or ""]).append(
                    (piece.function.arguments or "") if piece.function else ""
                )
            finish = choice.finish_reason or finish
    return [(p[0], "".join(p[1:])) for _, p in sorted(pieces.items())], finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_keeps_only_the_first_call_when_asked(oai: openai.OpenAI, stream: bool) -> None:
    both = [("add", json.dumps(c["arguments"])) for c in CALLS]
    assert _chat(oai, None, stream) == (both, "tool_calls")  # OpenAI's default: parallel
    assert _chat(oai, True, stream) == (both, "tool_calls")
    assert _chat(oai, False, stream) == (both[:1], "tool_calls")


def test_the_zmq_client_keeps_only_the_first_call_when_asked(api: HttpEngine) -> None:
    with Client(api.engine.endpoint, timeout_s=60) as c:
        kw: Any = {"messages": MESSAGES, "tools": TOOLS, "max_new_tokens": 80, "temperature": 0}
        kw["grammar"] = Grammar(kind="regex", spec=PATTERN)
        both = c.generate(**kw)
        first = c.generate(parallel_tool_calls=False, **kw)
    assert [call.arguments for call in both.tool_calls or []] == ['{"a": 2}', '{"a": 3}']
    assert [call.arguments for call in first.tool_calls or []] == ['{"a": 2}']
    assert first.finish_reason is both.finish_reason and first.text == both.text == ""
