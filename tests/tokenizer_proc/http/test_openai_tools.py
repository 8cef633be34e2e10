"""Tool calling through the official ``openai`` package against the embedded SmolLM2 (whose
template ignores tools, so they reach it in rivulet's Hermes-style system message).

What this proves: tools, tool_choice and a tool-call history are accepted and reach the prompt,
replies are well-formed OpenAI objects, and streaming adds up to the whole reply. Which text the
135M model writes is its own business; the parsing of calls is pinned by the unit tests
(tests/tokenizer_proc/chat/test_tool_parsers.py, test_replies.py). ``tool_choice="required"``
needs constrained decoding, so its test runs once the engine accepts grammars.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from client import Client
from protocol.grammar import Grammar
from protocol.messages import SamplingParams
from tests.tokenizer_proc.http.server import HttpEngine, http_engine

WEATHER: dict[str, object] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
ADD: dict[str, object] = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather now.", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]
ROUND_TRIP: list[ChatCompletionMessageParam] = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_7", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_7", "content": '{"temperature": 18, "sky": "clear"}'},
]  # fmt: skip
NAMES = {"get_weather", "add"}


def grammar_supported() -> bool:
    """Whether this build's engine accepts constrained decoding (the grammar branch is merged)."""
    from tokenizer_proc.model_info import ModelInfo
    from tokenizer_proc.validation import RequestRejected, _check_sampling

    info = ModelInfo(context_len=64, vocab_size=64, eos_token_ids=(0,))
    try:
        _check_sampling(SamplingParams(grammar=Grammar(kind="json_object")), info, echo=False)
    except RequestRejected:
        return False
    return True


@pytest.fixture(scope="module")
def smol_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpEngine]:
    tmp: Path = tmp_path_factory.mktemp("smol-tools")
    with http_engine(None, tmp, "--served-model-name", "smol") as engine:
        yield engine


@pytest.fixture(scope="module")
def smol(smol_engine: HttpEngine) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=smol_engine.v1, api_key="none", max_retries=0, timeout=120.0) as client:
        yield client


def _create(client: openai.OpenAI, messages: list[ChatCompletionMessageParam], **kw: Any) -> Any:
    kw = {"temperature": 0, "max_tokens": 40, **kw}
    return client.chat.completions.create(model="smol", messages=messages, **kw)


def _check_calls(calls: Any) -> None:
    for call in calls or []:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in NAMES
        assert isinstance(json.loads(call.function.arguments), dict)


def test_tools_auto_reach_the_prompt_and_the_reply_is_well_formed(smol: openai.OpenAI) -> None:
    plain = _create(smol, ASK)
    out = _create(smol, ASK, tools=TOOLS, tool_choice="auto")
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tool signatures are in the prompt
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.finish_reason == "tool_calls":
        assert (
            choice.message.tool_calls
            and choice.message.content is None
            or isinstance(choice.message.content, str)
        )
        _check_calls(choice.message.tool_calls)
    else:
        assert isinstance(choice.message.content, str) and choice.message.content


def test_tool_choice_none_offers_nothing(smol: openai.OpenAI) -> None:
    plain = _create(smol, ASK, max_tokens=1)
    out = _create(smol, ASK, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert out.usage.prompt_tokens == plain.usage.prompt_tokens and not out.choices[0].message.tool_calls


def test_a_tool_call_round_trip_is_accepted(smol: openai.OpenAI) -> None:
    first = _create(smol, ASK, tools=TOOLS, max_tokens=1)
    out = _create(smol, ROUND_TRIP, tools=TOOLS)
    assert out.usage.prompt_tokens > first.usage.prompt_tokens + 20  # the call and its result are in it
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    _check_calls(out.choices[0].message.tool_calls)


def test_streamed_reply_with_tools_adds_up_to_the_whole(smol: openai.OpenAI) -> None:
    whole = _create(smol, ROUND_TRIP, tools=TOOLS).choices[0]
    content, calls, reasons = "", {}, []
    for chunk in _create(smol, ROUND_TRIP, tools=TOOLS, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            if piece.id is not None:
                calls[piece.index] = [piece.function.name, ""]
            calls[piece.index][1] += piece.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert content == (whole.message.content or "") and reasons[-1] == whole.finish_reason
    expected = [[c.function.name, c.function.arguments] for c in whole.message.tool_calls or []]
    assert [calls[i] for i in sorted(calls)] == expected


def test_zmq_client_gives_the_same_reply(smol: openai.OpenAI, smol_engine: HttpEngine) -> None:
    http = _create(smol, ROUND_TRIP, tools=TOOLS).choices[0]
    with Client(smol_engine.engine.endpoint, timeout_s=120) as client:
        history: Any = ROUND_TRIP
        tools: Any = TOOLS
        out = client.generate(messages=history, tools=tools, max_new_tokens=40, temperature=0)
    assert out.text == (http.message.content or "") and (
        out.finish_reason.value if out.finish_reason else ""
    ) == (http.finish_reason)
    assert [(c.name, c.arguments) for c in out.tool_calls or []] == [
        (c.function.name, c.function.arguments) for c in http.message.tool_calls or []
    ]


def test_bad_tool_history_is_a_400_naming_the_field(smol: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        no_id: Any = {"role": "tool", "content": "18"}  # no tool_call_id
        _create(smol, [*ASK, no_id], tools=TOOLS)
    assert caught.value.body["param"] == "messages[1].tool_call_id"  # type: ignore[index]
    assert _create(smol, ASK, max_tokens=1).choices[0].finish_reason == "length"  # still serving


@pytest.mark.skipif(
    not grammar_supported(), reason="constrained decoding (grammar branch) is not in this build"
)
@pytest.mark.parametrize("seed", range(5))
def test_required_tool_choice_returns_arguments_valid_for_the_schema(smol: openai.OpenAI, seed: int) -> None:
    prompts = ["Weather in Oslo?", "Add 2 and 40.", "Is it cold in Lima?", "Sum 7 and 8.", "Rain in Rome?"]
    named = seed % 2 == 1
    choice: Any = {"type": "function", "function": {"name": "add"}} if named else "required"
    out = _create(smol, [{"role": "user", "content": prompts[seed]}], tools=TOOLS, tool_choice=choice,
                  temperature=0.7, seed=seed, max_tokens=150)  # fmt: skip
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.tool_calls, message
    (call,) = message.tool_calls
    assert not named or call.function.name == "add"
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
