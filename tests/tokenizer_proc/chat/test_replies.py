"""Crafted token streams through the tokenizer's Frontend (its real detokenizer, no model): chat
replies split into reasoning, content and tool calls, streamed pieces adding up to the whole reply."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import TYPE_CHECKING, Any

import msgspec
import pytest

from protocol.chat import ChatMessage, Tool
from protocol.messages import FinishReason, GenerateOutput, GenerateRequest, TokenBatch, TokenizedRequest
from tests.tokenizer_proc.chat.qwen3_style import QWEN3_STYLE_TEMPLATE
from tokenizer_proc.chat.output import merge_calls
from tokenizer_proc.frontend import Frontend
from tokenizer_proc.model_info import ModelInfo

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CLIENT = b"c"
USER = [ChatMessage(role="user", content="Add 1 and 2.")]
TOOLS = msgspec.convert(
    [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}], list[Tool]
)


@pytest.fixture(scope="module")
def qwen3_frontend(tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo) -> Frontend:
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = QWEN3_STYLE_TEMPLATE
    return Frontend(tok, model_info, seed=0)


def _reply(frontend: Frontend, output: str, stream: bool, rid: str, **fields: Any) -> list[GenerateOutput]:
    """Run a chat request whose model writes ``output``, one token per step; its replies."""
    req = GenerateRequest(rid=rid, messages=USER, stream=stream, **fields)
    out = asyncio.run(frontend.admit(CLIENT, req))
    (sent,) = out.to_scheduler
    assert isinstance(sent, TokenizedRequest)
    ids = frontend.tokenizer.encode(output, add_special_tokens=False)
    replies = []
    for i, token in enumerate(ids):
        finished = FinishReason.STOP if i == len(ids) - 1 else None
        batch = TokenBatch(
            rids=[sent.rid], token_ids=[token], logprobs=[0.0], finished=[finished], cached_tokens=[0]
        )
        replies += [reply for _, reply in frontend.on_scheduler_msg(batch).replies]
    assert replies and replies[-1].finish_reason is not None
    return replies


def _both(frontend: Frontend, output: str, **fields: Any) -> tuple[GenerateOutput, list[GenerateOutput]]:
    (whole,) = _reply(frontend, output, False, "whole", **fields)
    return whole, _reply(frontend, output, True, "stream", **fields)


def _summed(pieces: list[GenerateOutput]) -> tuple[str, str, list[tuple[str | None, str]]]:
    calls = merge_calls([c for p in pieces for c in p.tool_calls or []])
    return (
        "".join(p.text for p in pieces),
        "".join(p.reasoning_text for p in pieces),
        [(c.name, c.arguments) for c in calls],
    )


def test_reasoning_then_content_from_a_prompt_that_opened_think(qwen3_frontend: Frontend) -> None:
    output = "The user wants a sum.\nIt is 3.\n</think>\n\nThe answer is 3."
    whole, stream = _both(qwen3_frontend, output)
    assert (whole.reasoning_text, whole.text) == ("The user wants a sum.\nIt is 3.\n", "The answer is 3.")
    assert _summed(stream) == (whole.text, whole.reasoning_text, [])
    assert whole.finish_reason is FinishReason.STOP
    assert sum(1 for p in stream if p.reasoning_text) > 3  # reasoning streams token by token


def test_thinking_off_leaves_the_reply_as_content(qwen3_frontend: Frontend) -> None:
    output = "The answer is 3."
    whole, stream = _both(qwen3_frontend, output, chat_template_kwargs={"enable_thinking": False})
    assert (whole.reasoning_text, whole.text) == ("", output)
    assert _summed(stream) == (output, "", [])


def test_reasoning_then_a_tool_call(qwen3_frontend: Frontend) -> None:
    output = 'I need the add tool.</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'
    output += "\n</tool_call>"
    whole, stream = _both(qwen3_frontend, output, tools=TOOLS)
    assert whole.reasoning_text == "I need the add tool." and whole.text == ""
    assert whole.tool_calls is not None and len(whole.tool_calls) == 1
    call = whole.tool_calls[0]
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 1, "b": 2})
    assert call.id is not None and call.id.startswith("call_")
    assert (
        whole.finish_reason is FinishReason.TOOL_CALLS and stream[-1].finish_reason is FinishReason.TOOL_CALLS
    )
    assert _summed(stream) == ("", whole.reasoning_text, [("add", call.arguments)])
    assert sum(1 for p in stream for c in p.tool_calls or [] if c.id is None) > 1  # arguments in pieces


def test_smollm2_reply_without_think_tags_is_not_split(
    tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo
) -> None:
    frontend = Frontend(tokenizer, model_info, seed=0)
    output = "<think>not a reasoning model</think> Hi"
    whole, stream = _both(frontend, output)
    assert (whole.text, whole.reasoning_text, whole.tool_calls) == (output, "", None)
    assert _summed(stream) == (output, "", [])
