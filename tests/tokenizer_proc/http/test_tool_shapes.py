"""Chat replies with tool calls and reasoning as OpenAI bodies, read back by the ``openai``
package's own types (what a client parses), streamed and whole."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from openai.types.chat import ChatCompletion, ChatCompletionChunk

from protocol.chat import ToolCallDelta
from protocol.messages import FinishReason, GenerateOutput, Usage
from tokenizer_proc.http.completion_bodies import ResponseShape
from tokenizer_proc.token_bytes import TokenTexts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

USAGE = Usage(prompt_tokens=5, completion_tokens=7)


def _shape(tokenizer: PreTrainedTokenizerBase) -> ResponseShape:
    return ResponseShape(
        id="chatcmpl-1", model="m", created=0, chat=True, logprobs=False, include_usage=False,
        texts=TokenTexts(tokenizer),
    )  # fmt: skip


def test_whole_reply_with_calls_and_reasoning(tokenizer: PreTrainedTokenizerBase) -> None:
    calls = [ToolCallDelta(index=0, id="call_a", name="add", arguments='{"a": 1}'),
             ToolCallDelta(index=1, id="call_b", name="now", arguments="{}")]  # fmt: skip
    reply = GenerateOutput(
        rid="r", text="", reasoning_text="Two calls.", tool_calls=calls,
        finish_reason=FinishReason.TOOL_CALLS, usage=USAGE,
    )  # fmt: skip
    body = ChatCompletion.model_validate(_shape(tokenizer).whole([reply]))
    choice = body.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra == {"reasoning_content": "Two calls."}
    got = choice.message.tool_calls or []
    assert all(c.type == "function" for c in got)
    assert [(c.id, c.function.name, c.function.arguments) for c in got if c.type == "function"] == [
        ("call_a", "add", '{"a": 1}'), ("call_b", "now", "{}"),
    ]  # fmt: skip


def test_plain_reply_has_no_tool_fields(tokenizer: PreTrainedTokenizerBase) -> None:
    reply = GenerateOutput(rid="r", text="Hi", finish_reason=FinishReason.STOP, usage=USAGE)
    message = _shape(tokenizer).whole([reply])["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Hi"}


def test_streamed_pieces_become_openai_tool_call_deltas(tokenizer: PreTrainedTokenizerBase) -> None:
    shape = _shape(tokenizer)
    replies = [
        GenerateOutput(rid="r", reasoning_text="Hm"),
        GenerateOutput(rid="r", text="Sure. "),
        GenerateOutput(
            rid="r", tool_calls=[ToolCallDelta(index=0, id="call_a", name="add", arguments='{"a"')]
        ),
        GenerateOutput(rid="r", tool_calls=[ToolCallDelta(index=0, arguments=": 1}")]),
        GenerateOutput(rid="r", finish_reason=FinishReason.TOOL_CALLS, usage=USAGE),
    ]
    chunks = [
        ChatCompletionChunk.model_validate(json.loads(event.removeprefix(b"data: ")))
        for reply in replies
        for event in shape.events(0, reply)
    ]
    deltas = [c.choices[0].delta for c in chunks]
    assert [d.model_extra.get("reasoning_content") for d in deltas if d.model_extra] == ["Hm"]
    assert "".join(d.content or "" for d in deltas) == "Sure. "
    pieces = [p for d in deltas for p in d.tool_calls or []]
    assert (pieces[0].id, pieces[0].type, pieces[0].function and pieces[0].function.name) == (
        "call_a",
        "function",
        "add",
    )
    assert (
        pieces[1].id is None
        and "".join(p.function.arguments or "" for p in pieces if p.function) == '{"a": 1}'
    )
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
