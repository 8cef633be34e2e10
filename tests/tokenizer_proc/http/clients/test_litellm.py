"""litellm with the engine as an OpenAI-compatible provider (``openai/<model>`` and ``api_base``):
plain text, a forced tool call, a Pydantic ``response_format``, and streaming."""

from __future__ import annotations

import json
from typing import Any

import litellm
import pytest

from tests.tokenizer_proc.http.clients.common import (
    API_KEY,
    ASK,
    CITIES,
    LOOKUP_PARAMETERS,
    MODEL,
    Sent,
    Verdict,
)

# litellm builds pydantic schemas for its own TypedDicts on first use and pydantic warns about them
pytestmark = pytest.mark.filterwarnings("ignore:.*ReadOnly. qualifier:UserWarning")
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": LOOKUP_PARAMETERS}}]


@pytest.fixture(autouse=True)
def _quiet() -> None:
    litellm.telemetry = False


def _complete(sent: Sent, **kw: Any) -> Any:
    messages = [{"role": "user", "content": ASK}]
    return litellm.completion(
        model=f"openai/{MODEL}", api_base=sent.v1, api_key=API_KEY, messages=messages, temperature=0, **kw
    )


def test_text_reply_ends_at_max_tokens(sent: Sent) -> None:
    reply = _complete(sent, max_tokens=5)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5


def test_a_forced_tool_call_parses(sent: Sent) -> None:
    reply = _complete(sent, max_tokens=40, tools=TOOLS, tool_choice="required")
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "lookup" and json.loads(call.function.arguments)["city"] in CITIES


def test_a_pydantic_response_format_parses(sent: Sent) -> None:
    reply = _complete(sent, max_tokens=40, response_format=Verdict)
    assert Verdict.model_validate_json(reply.choices[0].message.content)


def test_a_stream_adds_up_to_its_usage(sent: Sent) -> None:
    chunks = list(_complete(sent, max_tokens=6, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage.completion_tokens == 6
