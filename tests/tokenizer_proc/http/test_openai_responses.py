"""The Responses API through the official ``openai`` package against a real engine (tiny random
Llama): create and stream, tools, previous_response_id, GET and DELETE, and the refusals.

A random model writes noise, so each reply is pinned against the chat completion of the same
conversation (greedy): the Responses API is a different shape of the same request.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.tokenizer_proc.http.server import API_KEY, HttpEngine

ADD: dict[str, Any] = {
    "type": "object",
    "properties": {"a": {"type": "integer", "enum": [2, 3, 5]}, "b": {"type": "integer", "enum": [2, 3, 5]}},
    "required": ["a", "b"],
}
TOOLS: Any = [{"type": "function", "name": "add", "description": "Add two numbers.", "parameters": ADD}]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
FORMAT: Any = {"format": {"type": "json_schema", "name": "place", "schema": SCHEMA, "strict": True}}


def _added_as_chat(arguments: str) -> Any:
    """The chat conversation the add tool's call and its result "5" make: what /v1/responses
    continues from."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": arguments}}
    return [
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]


def _chat_text(oai: openai.OpenAI, messages: list[ChatCompletionMessageParam], n: int) -> tuple[str, Any]:
    out = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=n, temperature=0)
    return out.choices[0].message.content or "", out.usage


def test_create_answers_as_chat_completions_does(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model="tiny", input="Name a river.", max_output_tokens=8, temperature=0)
    text, usage = _chat_text(oai, [{"role": "user", "content": "Name a river."}], 8)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == text and r.output[0].type == "message"
    assert r.status == "incomplete" and r.incomplete_details is not None  # 8 tokens of noise, no EOS
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, 8)
    assert r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.usage.input_tokens_details.cached_tokens >= 0 and r.temperature == 0
    assert (r.model_extra or {})["store"] is True


def test_items_and_instructions_are_the_chat_messages(oai: openai.OpenAI) -> None:
    parts = [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "!"}]
    items: Any = [
        {"role": "user", "content": parts},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Bye"},
    ]
    r = oai.responses.create(
        model="tiny",
        input=items,
        instructions="Speak French.",
        max_output_tokens=6,
        temperature=0,
        store=False,
    )
    messages: Any = [
        {"role": "system", "content": "Speak French."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Bye"},
    ]
    text, _ = _chat_text(oai, messages, 6)
    assert (
        r.output_text == text
        and r.instructions == "Speak French."
        and (r.model_extra or {})["store"] is False
    )


def test_stream_sends_the_documented_events(oai: openai.OpenAI) -> None:
    kw: Any = {"model": "tiny", "input": "Name a river.", "max_output_tokens": 8, "temperature": 0}
    whole = oai.responses.create(**kw)
    events = list(oai.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas == whole.output_text == final.output_text and final.id == events[0].response.id  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens == 8 and final.status == "incomplete"


def test_stream_helper_with_a_json_schema(oai: openai.OpenAI) -> None:
    class Place(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=8)

    with oai.responses.stream(model="tiny", input="Where?", text_format=Place, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and "".join(deltas) == final.output_text
    assert isinstance(final.output_parsed, Place)
    whole = oai.responses.create(model="tiny", input="Where?", text=FORMAT, temperature=0)
    jsonschema.validate(json.loads(whole.output_text), SCHEMA)
    assert (
        whole.text is not None and whole.text.format is not None and whole.text.format.type == "json_schema"
    )


def test_json_object_format(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model="tiny", input="JSON please", text={"format": {"type": "json_object"}},
                             max_output_tokens=64, temperature=0)  # fmt: skip
    if r.status == "completed":  # a random model may nest until the limit
        assert isinstance(json.loads(r.output_text), dict)
    assert r.output_text.startswith("{")


def test_forced_tool_call_whole_and_streamed(oai: openai.OpenAI) -> None:
    kw: Any = {"model": "tiny", "input": "Add 2 and 3.", "tools": TOOLS, "tool_choice": "required"}
    kw["temperature"] = 0
    r = oai.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "add"
    jsonschema.validate(json.loads(calls[0].arguments), ADD)
    assert calls[0].call_id.startswith("call_") and calls[0].id and calls[0].id.startswith("fc_")
    with oai.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    streamed = [o for o in final.output if o.type == "function_call"]
    assert deltas == done[0].arguments == calls[0].arguments == streamed[0].arguments
    assert streamed[0].parsed_arguments is None or streamed[0].name == "add"
    named = oai.responses.create(**{**kw, "tool_choice": {"type": "function", "name": "add"}})
    assert [o.type for o in named.output] == ["function_call"]


def test_tool_results_in_the_input(oai: openai.OpenAI) -> None:
    arguments = '{"a": 2, "b": 3}'
    items: Any = [
        {"role": "user", "content": "Add 2 and 3."},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
    ]
    r = oai.responses.create(
        model="tiny", input=items, tools=TOOLS, tool_choice="none", max_output_tokens=6, temperature=0
    )
    messages = _added_as_chat(arguments)
    text, _ = _chat_text(oai, messages, 6)
    assert r.output_text == text and r.tool_choice == "none"


def _reassembled(events: list[Any]) -> list[tuple[str, str, str]]:
    """The output items a stream's events build, as (type, name, text or arguments), each checked
    against its ``output_item.done``; the events must add, fill and finish every item in turn."""
    items: dict[int, list[str]] = {}
    for e in events:
        if e.type == "response.output_item.added":
            assert e.output_index not in items and e.output_index == len(items)
            items[e.output_index] = [e.item.type, getattr(e.item, "name", ""), ""]
        elif e.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
            items[e.output_index][2] += e.delta
        elif e.type == "response.output_item.done":
            kind, name, built = items[e.output_index]
            done = e.item.arguments if kind == "function_call" else e.item.content[0].text
            assert (e.item.type, done) == (kind, built), (e.item, built)
    return [(kind, name, built) for kind, name, built in (items[i] for i in sorted(items))]


def _items(response: Any) -> list[tuple[str, str, str]]:
    return [
        (o.type, o.name, o.arguments) if o.type == "function_call" else (o.type, "", o.content[0].text)
        for o in response.output
    ]


def test_a_multi_turn_tool_call_whole_and_streamed(oai: openai.OpenAI) -> None:
    """Response 1 calls the tool (forced: a random model calls nothing of its own); response 2
    continues it by previous_response_id with the call's output, tools offered but not to be called,
    and answers in text. Each turn whole and streamed (the stream helper reading every event): the
    events rebuild the whole response's items, and both conversations go on alike."""
    first_kw: Any = {"model": "tiny", "input": "Add 2 and 3.", "tools": TOOLS, "tool_choice": "required",
                     "temperature": 0}  # fmt: skip
    first = oai.responses.create(**first_kw)
    with oai.responses.stream(**first_kw) as stream:
        first_events = list(stream)
        first_streamed = stream.get_final_response()
    [(kind, name, arguments)] = _items(first)
    assert (kind, name, first.status) == ("function_call", "add", "completed")
    jsonschema.validate(json.loads(arguments), ADD)
    assert _reassembled(first_events) == _items(first_streamed) == _items(first)

    def second_kw(previous: Any) -> Any:
        [call] = [o for o in previous.output if o.type == "function_call"]
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
        return {"model": "tiny", "input": [result], "previous_response_id": previous.id, "tools": TOOLS,
                "tool_choice": "none", "max_output_tokens": 8, "temperature": 0}  # fmt: skip

    second = oai.responses.create(**second_kw(first))
    # the streamed turn continues the streamed first turn: its call has other ids, and the prompt
    # (the template's Hermes-style text) shows no ids, so the conversation is the same
    with oai.responses.stream(**second_kw(first_streamed)) as stream:
        second_events: list[Any] = list(stream)
    second_streamed = second_events[-1].response
    assert second_events[-1].type == "response.incomplete"  # 8 tokens of noise
    assert [kind for kind, _, _ in _items(second)] == ["message"] and second.output_text
    assert _reassembled(second_events) == _items(second_streamed) == _items(second)
    assert (
        second.previous_response_id == first.id and second_streamed.previous_response_id == first_streamed.id
    )
    messages = _added_as_chat(arguments)
    text, usage = _chat_text(oai, messages, 8)
    assert second.output_text == text and second.usage is not None and second_streamed.usage is not None
    assert second.usage.input_tokens == second_streamed.usage.input_tokens == usage.prompt_tokens


def test_previous_response_id_continues_the_conversation(oai: openai.OpenAI) -> None:
    first = oai.responses.create(model="tiny", input="Hi there, how are you?", max_output_tokens=5,
                                 temperature=0, instructions="Only in the first.")  # fmt: skip
    second = oai.responses.create(model="tiny", input="And then?", previous_response_id=first.id,
                                  max_output_tokens=5, temperature=0)  # fmt: skip
    text, usage = _chat_text(oai, [{"role": "user", "content": "Hi there, how are you?"},
                                   {"role": "assistant", "content": first.output_text},
                                   {"role": "user", "content": "And then?"}], 5)  # fmt: skip
    assert second.output_text == text and second.previous_response_id == first.id
    assert second.usage is not None and second.usage.input_tokens == usage.prompt_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt pages
    third = oai.responses.create(model="tiny", input="Last.", previous_response_id=second.id,
                                 max_output_tokens=3, temperature=0)  # fmt: skip
    assert third.usage is not None and third.usage.input_tokens > second.usage.input_tokens


def test_get_and_delete(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model="tiny", input="Keep me.", max_output_tokens=4, temperature=0)
    assert oai.responses.retrieve(r.id).model_dump() == r.model_dump()
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as lookup:
        oai.responses.retrieve(r.id)
    assert r.id in lookup.value.message
    with pytest.raises(openai.NotFoundError) as follow:
        oai.responses.create(model="tiny", input="x", previous_response_id=r.id, max_output_tokens=2)
    assert isinstance(follow.value.body, dict) and follow.value.body["param"] == "previous_response_id"
    unstored = oai.responses.create(model="tiny", input="Forget me.", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
    streamed = list(oai.responses.create(model="tiny", input="Stream me.", max_output_tokens=2, stream=True))
    final = streamed[-1].response  # type: ignore[union-attr]
    assert oai.responses.retrieve(final.id).output_text == final.output_text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "web_search_preview"}, "tools": TOOLS}, "tool_choice"),
        ({"background": True}, "background"),
        ({"include": ["reasoning.encrypted_content"]}, "include[0]"),
        ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].image_url"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": "x", "colour": 1}]}, "input[0].colour"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 1}}}}, "text.format"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "sub"}}, "tool_choice"),
        ({"tools": [{**TOOLS[0], "name": "bad name"}]}, "tools[0].name"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)  # fmt: skip
def test_what_is_not_supported_is_a_400_naming_it(
    oai: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    body = {"input": "x", "max_output_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model="tiny", input=body.pop("input"), extra_body=body)
    assert isinstance(err.value.body, dict) and err.value.body["param"] == param, err.value.body


def test_max_output_tokens_beyond_the_context_is_context_length_exceeded(oai: openai.OpenAI) -> None:
    """A max_output_tokens that cannot fit beside the prompt in the tiny Llama's 1024-token context
    is a 400 context_length_exceeded naming it, streamed or not, as chat's max_completion_tokens;
    one that fits exactly runs."""
    text = "river " * 990
    probe = oai.responses.create(model="tiny", input=text, max_output_tokens=1, store=False)
    assert probe.usage is not None
    room = 1024 - probe.usage.input_tokens
    assert 0 < room < 64, room
    for limit, stream in [(10**9, False), (room + 1, False), (room + 1, True)]:
        with pytest.raises(openai.BadRequestError) as err:
            oai.responses.create(model="tiny", input=text, max_output_tokens=limit, stream=stream)
        body = err.value.body
        assert isinstance(body, dict) and body["code"] == "context_length_exceeded", body
        assert body["param"] == "max_output_tokens" and str(limit) in body["message"], body
    exact = oai.responses.create(model="tiny", input=text, max_output_tokens=room, temperature=0, store=False)
    assert exact.usage is not None and 0 < exact.usage.output_tokens <= room


def test_logprobs_are_included_when_asked(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model="tiny", input="Hi", max_output_tokens=4, temperature=0, top_logprobs=2,
                             include=["message.output_text.logprobs"])  # fmt: skip
    message = r.output[0]
    assert message.type == "message"
    part = message.content[0]
    assert part.type == "output_text" and part.logprobs is not None and len(part.logprobs) == 4
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    assert "".join(lp.token for lp in part.logprobs) == part.text


def test_unknown_routes_and_keys(api: HttpEngine) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(api.v1 + "/responses/resp_nope", headers=headers).status_code == 404
    assert httpx.get(api.v1 + "/responses/resp_nope").status_code == 401
    got = httpx.get(api.v1 + "/responses/resp_nope?stream=true", headers=headers)
    assert got.status_code == 400 and got.json()["error"]["param"] == "stream"
