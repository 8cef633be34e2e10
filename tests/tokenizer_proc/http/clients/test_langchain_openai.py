"""langchain-openai's ``ChatOpenAI`` against the tiny engine: ``bind_tools`` with a forced tool,
``with_structured_output`` by each method, and the same through ``use_responses_api=True``."""

from __future__ import annotations

from typing import Any, Literal

import openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import SecretStr

from tests.tokenizer_proc.http.clients.common import API_KEY, ASK, CITIES, MODEL, Sent, Verdict


@tool
def lookup(city: Literal["paris", "rome"]) -> str:
    """The weather in a city."""
    return "sunny"


def _chat(sent: Sent, **kw: Any) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL,
        base_url=sent.v1,
        api_key=SecretStr(API_KEY),
        max_retries=0,
        temperature=0,
        http_client=sent.http_client(),
        **{"max_tokens": 40, **kw},
    )


@pytest.mark.parametrize("responses_api", [False, True], ids=["chat", "responses"])
def test_bind_tools_with_a_forced_tool_calls_it(sent: Sent, responses_api: bool) -> None:
    chat = _chat(sent, use_responses_api=responses_api)
    reply = chat.bind_tools([lookup], tool_choice="lookup").invoke(ASK)
    (call,) = reply.tool_calls
    assert call["name"] == "lookup" and call["args"]["city"] in CITIES
    assert lookup.invoke(call["args"]) == "sunny"  # the parsed arguments are the tool's own


@pytest.mark.parametrize("responses_api", [False, True], ids=["chat", "responses"])
def test_a_tool_round_trip_then_a_structured_answer(sent: Sent, responses_api: bool) -> None:
    """The call LangChain parsed, and the tool's result, go back as history the engine accepts."""
    chat = _chat(sent, use_responses_api=responses_api)
    call_reply = chat.bind_tools([lookup], tool_choice="lookup").invoke(ASK)
    (call,) = call_reply.tool_calls
    result = ToolMessage(lookup.invoke(call["args"]), tool_call_id=call["id"])
    history = [HumanMessage(ASK), call_reply, result]
    verdict = chat.with_structured_output(Verdict, method="json_schema").invoke(history)
    assert isinstance(verdict, Verdict)
    endpoint, field = ("responses", "input") if responses_api else ("chat/completions", "messages")
    assert [len(body[field]) for body in sent.to(endpoint)] == [1, 3]


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
@pytest.mark.parametrize("responses_api", [False, True], ids=["chat", "responses"])
def test_with_structured_output_parses(sent: Sent, method: str, responses_api: bool) -> None:
    chat = _chat(sent, use_responses_api=responses_api)
    verdict = chat.with_structured_output(Verdict, method=method).invoke(ASK)  # type: ignore[arg-type]
    assert isinstance(verdict, Verdict)


def test_with_structured_output_json_mode_is_constrained_to_an_object(sent: Sent) -> None:
    """``json_mode`` asks for any JSON object, and no API field makes the random model close one (it
    writes one endless string), so openai's parser raises at ``max_tokens``; what is checked is that
    the engine took the request and its reply is the start of an object (its grammar's doing)."""
    chat = _chat(sent, max_tokens=16).with_structured_output(Verdict, method="json_mode")
    with pytest.raises(openai.LengthFinishReasonError) as caught:
        chat.invoke(ASK)
    content = caught.value.completion.choices[0].message.content
    assert content is not None and content.startswith("{")
    assert sent.to("chat/completions")[0]["response_format"] == {"type": "json_object"}
