"""What the OpenAI API accepts, rivulet accepts (issue 51, items 1-6), through the ``openai``
package against the shared tiny engine.

The tiny model's weights are random: the tests pin protocol outcomes (a grammar made the reply a
call, a field was accepted and echoed), never its prose. Tools take only enum arguments, so a
forced call is a few tokens whatever the weights.
"""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from protocol.chat import ChatMessage, FunctionCall, Tool, ToolCall, ToolChoice
from protocol.messages import GenerateRequest
from tests.tokenizer_proc.http.server import HttpEngine
from tokenizer_proc.chat.tool_checks import offered_tools
from tokenizer_proc.http.convert import chat_request
from tokenizer_proc.http.responses_input import without_oldest_item
from tokenizer_proc.http.schemas import ChatCompletionRequest, decode_body

PICK_ARGS = {
    "type": "object",
    "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
    "required": ["colour"],
    "additionalProperties": False,
}
PICK: ChatCompletionToolParam = {"type": "function", "function": {"name": "pick", "parameters": PICK_ARGS}}
STOP: ChatCompletionToolParam = {"type": "function", "function": {"name": "stop", "parameters": PICK_ARGS}}
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Pick a colour."}]
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
RESPONSE_FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True},
}
TEXT_FORMAT: Any = {
    "format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}
}


def _responses_tool(tool: ChatCompletionToolParam) -> Any:
    return {"type": "function", **tool["function"]}


# Item 1: a forced call beside a format: the format is for text, and a forced call writes none.


def test_chat_forced_call_beside_response_format_is_a_call(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(
        model="tiny", messages=ASK, tools=[PICK, STOP], tool_choice="required",
        response_format=RESPONSE_FORMAT, max_tokens=40,
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name in {"pick", "stop"}
    assert json.loads(call.function.arguments)["colour"] in {"red", "blue"}


def test_responses_forced_call_beside_text_format_is_a_call(oai: openai.OpenAI) -> None:
    r = oai.responses.create(
        model="tiny", input="Pick a colour.", tools=[_responses_tool(PICK)],
        tool_choice={"type": "function", "name": "pick"}, text=TEXT_FORMAT, max_output_tokens=40,
    )  # fmt: skip
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1, r.output
    assert calls[0].name == "pick" and json.loads(calls[0].arguments)["colour"] in {"red", "blue"}
    assert r.text is not None and r.text.format is not None
    assert r.text.format.type == "json_schema", "the format is echoed as sent"


# Item 2: tool_choice allowed_tools: only the listed tools are offered, called freely or at least once.


def test_chat_allowed_tools_required_calls_a_listed_tool(oai: openai.OpenAI) -> None:
    choice: Any = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "stop"}}]}}  # fmt: skip
    r = oai.chat.completions.create(
        model="tiny", messages=ASK, tools=[PICK, STOP], tool_choice=choice, max_tokens=40
    )
    calls = r.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["stop"], r.choices[0]  # type: ignore[union-attr]


def test_allowed_tools_auto_offers_only_the_listed_tools() -> None:
    tools = msgspec.convert([PICK, STOP], list[Tool])
    choice = msgspec.json.decode(
        b'{"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": '
        b'[{"type": "function", "function": {"name": "pick"}}]}}',
        type=ToolChoice,
    )
    offered, forced = offered_tools(tools, choice)
    assert [t.function.name for t in offered] == ["pick"] and not forced


def test_responses_allowed_tools_required_calls_a_listed_tool(oai: openai.OpenAI) -> None:
    r = oai.responses.create(
        model="tiny", input="Pick a colour.", tools=[_responses_tool(PICK), _responses_tool(STOP)],
        tool_choice=_responses_allowed("required", "pick"), max_output_tokens=40,
    )  # fmt: skip
    assert [item.name for item in r.output if item.type == "function_call"] == ["pick"], r.output
    assert r.tool_choice.type == "allowed_tools", "echoed as sent"  # type: ignore[union-attr]


def test_allowed_tools_naming_an_unknown_tool_is_a_400_naming_it(oai: openai.OpenAI) -> None:
    listed = [{"type": "function", "function": {"name": name}} for name in ("pick", "fly")]
    chat_choice: Any = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": listed}}
    with pytest.raises(openai.BadRequestError) as chat:
        oai.chat.completions.create(model="tiny", messages=ASK, tools=[PICK], tool_choice=chat_choice)
    assert _error(chat.value)["param"] == "tool_choice.allowed_tools.tools[1]"
    assert "'fly'" in _error(chat.value)["message"]
    with pytest.raises(openai.BadRequestError) as responses:
        oai.responses.create(
            model="tiny", input="x", tools=[_responses_tool(PICK)],
            tool_choice=_responses_allowed("auto", "fly"),
        )  # fmt: skip
    assert _error(responses.value)["param"] == "tool_choice.tools[0]"


def _responses_allowed(mode: str, *names: str) -> Any:
    return {"type": "allowed_tools", "mode": mode, "tools": [{"type": "function", "name": n} for n in names]}


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    assert isinstance(exc.body, dict), exc.body
    return exc.body


# Item 3: chat-completions fields OpenAI documents: accepted, echoed where its reply echoes them.


def test_chat_accepts_openais_request_fields_and_echoes_tier_and_metadata(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=2, metadata={"run": "7"}, store=True, service_tier="flex",
        prompt_cache_key="k", prompt_cache_retention="in_memory", safety_identifier="u-1",
        reasoning_effort="low", verbosity="low", modalities=["text"],
    )  # fmt: skip
    assert r.service_tier == "default" and r.metadata == {"run": "7"}
    assert r.choices[0].finish_reason in {"stop", "length"}


def test_reasoning_effort_is_a_template_variable() -> None:
    body = {"messages": ASK, "reasoning_effort": "none", "chat_template_kwargs": {"x": 1}}
    req = chat_request(decode_body(msgspec.json.encode(body), ChatCompletionRequest), "r")
    assert req.chat_template_kwargs == {"reasoning_effort": "none", "enable_thinking": False, "x": 1}


def test_legacy_functions_are_tools_answered_as_function_call(oai: openai.OpenAI) -> None:
    functions: Any = [PICK["function"]]
    r = oai.chat.completions.create(
        model="tiny", messages=ASK, functions=functions, function_call={"name": "pick"}, max_tokens=40
    )
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "function_call" and message.tool_calls is None, r.choices[0]
    assert message.function_call is not None and message.function_call.name == "pick"
    assert json.loads(message.function_call.arguments)["colour"] in {"red", "blue"}
    history: Any = [*ASK, {"role": "assistant", "content": None, "function_call": {
        "name": "pick", "arguments": message.function_call.arguments}},
        {"role": "function", "name": "pick", "content": "picked"}]  # fmt: skip
    chunks = list(oai.chat.completions.create(
        model="tiny", messages=history, functions=functions, function_call={"name": "pick"},
        max_tokens=40, stream=True,
    ))  # fmt: skip
    names = [
        c.choices[0].delta.function_call.name
        for c in chunks
        if c.choices and c.choices[0].delta.function_call
    ]
    assert names[0] == "pick" and chunks[-1].choices[0].finish_reason == "function_call"


# Item 4: an explicit null where OpenAI marks the field nullable is the default.


def test_chat_nulls_are_the_defaults(oai: openai.OpenAI) -> None:
    nulls = {"n": None, "logprobs": None, "stream": None, "presence_penalty": None, "frequency_penalty": None}
    r = oai.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, extra_body=nulls)
    assert len(r.choices) == 1 and r.choices[0].logprobs is None and r.object == "chat.completion"


def test_completions_nulls_are_the_defaults(oai: openai.OpenAI) -> None:
    nulls = {"n": None, "stream": None, "presence_penalty": None, "frequency_penalty": None, "echo": None}
    r = oai.completions.create(model="tiny", prompt="Hello", max_tokens=2, extra_body=nulls)
    assert len(r.choices) == 1 and not r.choices[0].text.startswith("Hello")
    assert r.object == "text_completion"


# Item 5: Responses truncation "auto" drops the oldest input items until the input fits.


def test_responses_truncation_auto_drops_the_oldest_items(oai: openai.OpenAI) -> None:
    """Eight user items of ~200 tokens each do not fit the tiny Llama's 1024-token context."""
    items: Any = [{"role": "user", "content": f"item {i}: " + "apple " * 200} for i in range(8)]
    with pytest.raises(openai.BadRequestError) as whole:
        oai.responses.create(model="tiny", input=items, max_output_tokens=2)
    assert _error(whole.value)["code"] == "context_length_exceeded"
    r = oai.responses.create(
        model="tiny", instructions="Be brief.", input=items, max_output_tokens=2, truncation="auto",
        prompt_cache_retention="in_memory", service_tier="priority", text={"verbosity": "high"},
    )  # fmt: skip
    assert r.status in {"completed", "incomplete"} and r.usage is not None
    assert 200 * 2 < r.usage.input_tokens < 1024 - 2, "some items dropped, the newest kept"
    assert r.truncation == "auto" and r.prompt_cache_retention == "in_memory"
    assert r.service_tier == "default", "the tier that served it"
    assert r.text is not None and r.text.verbosity == "high"
    assert r.instructions == "Be brief."


def test_truncation_keeps_the_instructions_and_drops_orphaned_results() -> None:
    call = ToolCall(id="c", function=FunctionCall(name="pick", arguments="{}"))
    messages = [
        ChatMessage(role="system", content="rules"),
        ChatMessage(role="assistant", content=None, tool_calls=[call]),
        ChatMessage(role="tool", content="red", tool_call_id="c"),
        ChatMessage(role="user", content="again"),
    ]
    shorter = without_oldest_item(GenerateRequest(rid="r", messages=messages), kept=1)
    assert shorter is not None and shorter.messages == [messages[0], messages[3]]
    assert without_oldest_item(shorter, kept=1) is None, "the newest item is never dropped"


# The operator sees every 4xx in the log (uvicorn's access log is off).


def test_a_4xx_is_logged_with_route_status_param_and_message(oai: openai.OpenAI, api: HttpEngine) -> None:
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="tiny", messages=ASK, extra_body={"verbosity": "loud"})
    with pytest.raises(openai.NotFoundError):
        oai.models.with_raw_response.retrieve("nothing-here")
    logged = _wait_for_line(api, "/v1/chat/completions -> 400 invalid_value (param verbosity):")
    assert "must be one of ['low', 'medium', 'high']" in logged
    assert "GET /v1/models/nothing-here -> 404" in _wait_for_line(api, "/v1/models/nothing-here")


def _wait_for_line(api: HttpEngine, needle: str) -> str:
    """The first log line holding ``needle``, waiting for the tokenizer process to write it."""
    for _ in range(100):
        lines = [line for line in api.engine.log().splitlines() if needle in line]
        if lines:
            return lines[0]
        time.sleep(0.05)
    raise AssertionError(f"no log line holds {needle!r}")


# Item 6: tools with tool_choice auto beside a format: a call or text in the format, one grammar.

LT, BRACE = "44", "107"  # SmolLM2's tokens "<" (a <tool_call> block starts so) and "{"


def test_chat_auto_tools_beside_a_format_may_call_or_answer_in_it(oai: openai.OpenAI) -> None:
    """A logit bias picks the branch: "<" opens a call (the model could never call before),
    "{" the format; the grammar writes the rest either way."""
    ask: Any = dict(model="tiny", messages=ASK, tools=[PICK, STOP], tool_choice="auto",
                    response_format=RESPONSE_FORMAT, max_tokens=60, temperature=0)  # fmt: skip
    # One call: the bias would otherwise open one call after another.
    called = oai.chat.completions.create(**ask, logit_bias={LT: 100}, parallel_tool_calls=False)
    calls = called.choices[0].message.tool_calls or []
    assert called.choices[0].finish_reason == "tool_calls" and calls, called.choices[0]
    assert json.loads(calls[0].function.arguments)["colour"] in {"red", "blue"}  # type: ignore[union-attr]
    answered = oai.chat.completions.create(**ask, logit_bias={BRACE: 100})
    assert answered.choices[0].finish_reason == "stop" and not answered.choices[0].message.tool_calls
    assert json.loads(answered.choices[0].message.content or "")["answer"] in {"yes", "no"}


def test_responses_auto_tools_beside_a_format_answer_a_call_or_the_format(oai: openai.OpenAI) -> None:
    r = oai.responses.create(
        model="tiny", input="Pick a colour.", tools=[_responses_tool(PICK)], text=TEXT_FORMAT,
        max_output_tokens=60, temperature=0,
    )  # fmt: skip
    assert r.status == "completed", r
    calls = [item for item in r.output if item.type == "function_call"]
    if calls:
        assert calls[0].name == "pick" and json.loads(calls[0].arguments)["colour"] in {"red", "blue"}
    else:
        assert json.loads(r.output_text)["answer"] in {"yes", "no"}
