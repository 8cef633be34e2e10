"""The Responses API without an engine: input items -> chat messages, replies -> output items and
events (streamed pieces and a whole reply end in the same items), and the bounded store."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from protocol.chat import ChatMessage, FunctionCall, NamedToolChoice, ToolCall, ToolCallDelta
from protocol.messages import FinishReason, GenerateOutput, Usage
from tokenizer_proc.http.errors import ApiError
from tokenizer_proc.http.responses_input import generate_request, input_messages
from tokenizer_proc.http.responses_output import OutputItems
from tokenizer_proc.http.responses_run import ResponseRun
from tokenizer_proc.http.responses_schema import ResponsesRequest, unsupported_fields
from tokenizer_proc.http.responses_store import ResponseStore
from tokenizer_proc.http.schemas import decode_body

TOOL = {"type": "function", "name": "add", "parameters": {"type": "object", "properties": {}}}


def _body(**fields: Any) -> ResponsesRequest:
    return decode_body(msgspec.json.encode({"input": "hi", **fields}), ResponsesRequest)


def _param(fn: Any, *args: Any) -> str | None:
    with pytest.raises(ApiError) as err:
        fn(*args)
    assert err.value.status == 400
    return err.value.param


def test_input_items_become_chat_messages() -> None:
    items: list[dict[str, Any]] = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add "},
                                                        {"type": "input_text", "text": "2 and 3"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Sure.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}", "id": "fc_1"},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "5"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "6"}]},
        {"type": "function_call", "call_id": "c3", "name": "add", "arguments": "{}"},
    ]  # fmt: skip
    calls = [ToolCall(id=c, function=FunctionCall(name="add", arguments="{}")) for c in ("c1", "c2", "c3")]
    assert input_messages(items) == [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Add 2 and 3"),
        ChatMessage(role="assistant", content="Sure.", tool_calls=calls[:2], reasoning="hm"),
        ChatMessage(role="tool", content="5", tool_call_id="c1"),
        ChatMessage(role="tool", content="6", tool_call_id="c2"),
        ChatMessage(role="assistant", content=None, tool_calls=calls[2:]),
    ]


def test_request_mapping() -> None:
    history = [ChatMessage(role="user", content="before")]
    body = _body(instructions="Rules.", max_output_tokens=7, temperature=0.5, top_p=0.9, tools=[TOOL],
                 tool_choice={"type": "function", "name": "add"}, reasoning={"effort": "none"})  # fmt: skip
    req = generate_request(body, "resp_1", history)
    assert req.messages == [
        ChatMessage(role="system", content="Rules."),
        *history,
        ChatMessage(role="user", content="hi"),
    ]
    assert (req.sampling.max_new_tokens, req.sampling.temperature, req.sampling.top_p) == (7, 0.5, 0.9)
    # the forced call: its grammar is put in as the request is admitted (tokenizer_proc/intake.py)
    assert isinstance(req.tool_choice, NamedToolChoice) and req.sampling.grammar is None
    assert req.chat_template_kwargs == {"reasoning_effort": "none", "enable_thinking": False}
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}}
    grammar = generate_request(_body(text=fmt), "r", []).sampling.grammar
    assert grammar is not None and (grammar.kind, grammar.strict) == ("json_schema", True)
    assert generate_request(_body(include=["message.output_text.logprobs"]), "r", []).logprobs
    assert req.parallel_tool_calls  # OpenAI's default
    assert not generate_request(_body(tools=[TOOL], parallel_tool_calls=False), "r", []).parallel_tool_calls


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call", "call_id": "c"}]}, "input[0].name"),  # the first missing
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0]"),
        ({"tools": [TOOL, {"type": "mcp", "server_label": "x"}]}, "tools[1].type"),
        ({"tools": [{**TOOL, "colour": 1}]}, "tools[0].colour"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ],
)  # fmt: skip
def test_request_refusals(fields: dict[str, Any], param: str) -> None:
    assert _param(generate_request, _body(**fields), "r", []) == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"max_tool_calls": 3}, "max_tool_calls"),
        ({"service_tier": "cheapest"}, "service_tier"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_obfuscation": True}},
         "stream_options.include_obfuscation"),
        ({"text": {"verbosity": "loud"}}, "text.verbosity"),
        ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
        ({"include": ["message.output_text.logprobs", "file_search_call.results"]}, "include[1]"),
    ],
)  # fmt: skip
def test_unsupported_fields(fields: dict[str, Any], param: str) -> None:
    assert _param(unsupported_fields, _body(**fields)) == param


class _Texts:
    """TokenTexts' two lookups over a made-up vocabulary: token i shows as "<i>"."""

    def text_of(self, token_id: int) -> str:
        return f"<{token_id}>"

    def bytes_of(self, token_id: int) -> bytes:
        return self.text_of(token_id).encode()


def _replies() -> list[GenerateOutput]:
    first = ToolCallDelta(index=0, id="call_a", name="add", arguments='{"a"')
    return [
        GenerateOutput(rid="r", reasoning_text="Let me "),
        GenerateOutput(rid="r", reasoning_text="think.", text="Sure"),
        GenerateOutput(rid="r", text=", adding.", tool_calls=[first]),
        GenerateOutput(rid="r", tool_calls=[ToolCallDelta(index=0, arguments=": 1}")]),
        GenerateOutput(rid="r", tool_calls=[ToolCallDelta(index=1, id="call_b", name="add", arguments="{}")]),
    ]


def _whole() -> GenerateOutput:
    calls = [ToolCallDelta(index=0, id="call_a", name="add", arguments='{"a": 1}'),
             ToolCallDelta(index=1, id="call_b", name="add", arguments="{}")]  # fmt: skip
    return GenerateOutput(rid="r", reasoning_text="Let me think.", text="Sure, adding.", tool_calls=calls)


def _strip_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


def test_streamed_pieces_and_a_whole_reply_make_the_same_items() -> None:
    streamed = OutputItems(_Texts(), logprobs=False)  # type: ignore[arg-type]
    events = [e for reply in _replies() for e in streamed.feed(reply)] + streamed.finish("completed")
    whole = OutputItems(_Texts(), logprobs=False)  # type: ignore[arg-type]
    whole.feed(_whole())
    whole.finish("completed")
    assert _strip_ids(streamed.items) == _strip_ids(whole.items)
    assert [i["type"] for i in whole.items] == ["reasoning", "message", "function_call", "function_call"]
    assert (
        whole.items[1]["content"][0]["text"] == "Sure, adding." and whole.items[2]["arguments"] == '{"a": 1}'
    )
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
    ]  # fmt: skip
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2, 3]
    added = events[14]["item"]
    assert (added["status"], added["arguments"], added["call_id"]) == ("in_progress", "", "call_a")


def test_logprobs_ride_on_the_text_that_shows_them() -> None:
    items = OutputItems(_Texts(), logprobs=True)  # type: ignore[arg-type]
    held = items.feed(GenerateOutput(rid="r", token_ids=[7], logprobs=[-0.5]))  # no text yet
    events = items.feed(GenerateOutput(rid="r", text="ab", token_ids=[8], logprobs=[-0.25]))
    items.feed(GenerateOutput(rid="r", token_ids=[2], logprobs=[-0.1]))  # EOS: no text of its own
    items.finish("completed")
    assert held == [] and [lp["token"] for lp in events[-1]["logprobs"]] == ["<7>", "<8>"]
    assert [lp["logprob"] for lp in items.items[0]["content"][0]["logprobs"]] == [-0.5, -0.25, -0.1]


def test_a_finished_run_is_stored_with_its_conversation() -> None:
    store = ResponseStore()
    output = OutputItems(_Texts(), logprobs=False)  # type: ignore[arg-type]
    asked = [ChatMessage(role="user", content="hi")]
    run = ResponseRun("resp_1", {"object": "response"}, asked, output, store, count_tokens=len)
    usage = Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=2)
    body, _ = run.finish(msgspec.structs.replace(_whole(), finish_reason=FinishReason.LENGTH, usage=usage))
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"] == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 2},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 13},  # len("Let me think.")
        "total_tokens": 8,
    }
    assert all(item["status"] == "incomplete" for item in body["output"][-1:])
    entry = store.get("resp_1")
    assert entry is not None and entry.body is body
    assert [m.role for m in entry.conversation] == ["user", "assistant"]
    assert (
        entry.conversation[1].content == "Sure, adding." and len(entry.conversation[1].tool_calls or []) == 2
    )


def test_store_is_an_lru_with_a_time_to_live() -> None:
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl_s=10.0, clock=lambda: now[0])
    store.put("a", {"id": "a"}, [])
    store.put("b", {"id": "b"}, [])
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", {"id": "c"}, [])
    assert (store.get("b"), len(store)) == (None, 2)
    now[0] = 10.5
    assert store.get("a") is None and store.get("c") is None and len(store) == 0
    store.put("d", {"id": "d"}, [])
    assert store.delete("d") and not store.delete("d") and store.get("d") is None
