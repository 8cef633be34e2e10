"""The one way in (tokenizer_proc/intake.py): a forced tool call's grammar is put in
where a request begins, whichever door it came by, and both doors start the same request."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import msgspec
import pytest

from protocol.chat import ChatMessage, NamedFunction, NamedToolChoice, Tool, ToolChoice
from protocol.grammar import Grammar
from protocol.messages import GenerateRequest, SamplingParams, TokenizedRequest
from tokenizer_proc.chat.tool_checks import forced_call_grammar
from tokenizer_proc.frontend import Frontend
from tokenizer_proc.http.convert import chat_request, rejection_error
from tokenizer_proc.http.schemas import ChatCompletionRequest, decode_body
from tokenizer_proc.model_info import ModelInfo
from tokenizer_proc.validation import RequestRejected

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
TOOLS = msgspec.convert([TOOL], list[Tool])
USER = [ChatMessage(role="user", content="Add 1 and 2.")]


@pytest.fixture
def frontend(tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo) -> Frontend:
    return Frontend(tokenizer, model_info, seed=0)


def _chat(choice: ToolChoice, **fields: Any) -> GenerateRequest:
    fields.setdefault("rid", "r")
    return GenerateRequest(messages=USER, tools=TOOLS, tool_choice=choice, **fields)


def test_a_forced_choice_gets_its_grammar_as_it_begins(frontend: Frontend) -> None:
    pending = frontend.intake.begin(b"c", _chat("required"))
    assert pending.forced and pending.req.sampling.grammar == forced_call_grammar(TOOLS, "required")
    free = frontend.intake.begin(b"c", _chat("auto"))
    assert not free.forced and free.req.sampling.grammar is None
    assert not free.compiled, "its tool's parameters schema is still to be checked"


def test_the_http_conversion_leaves_the_forced_grammar_to_the_intake(frontend: Frontend) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "tool_choice": "required"}
    req = chat_request(decode_body(msgspec.json.encode(body), ChatCompletionRequest), "r")
    assert req.sampling.grammar is None
    assert frontend.intake.begin(b"c", req).req.sampling.grammar is not None


def test_a_forced_call_replaces_the_clients_grammar(frontend: Frontend) -> None:
    """A format is for text and a forced call writes none (OpenAI accepts both at once)."""
    req = _chat("required", sampling=SamplingParams(grammar=Grammar(kind="json_object")))
    pending = frontend.intake.begin(b"c", req)
    assert pending.forced and pending.req.sampling.grammar == forced_call_grammar(TOOLS, "required")


def test_a_forced_call_that_cannot_be_is_refused_naming_tool_choice(frontend: Frontend) -> None:
    req = _chat(NamedToolChoice(function=NamedFunction(name="mul")))
    with pytest.raises(RequestRejected) as caught:
        frontend.intake.begin(b"c", req)
    assert caught.value.param == "tool_choice" and "mul" in caught.value.detail
    error = rejection_error(caught.value, chat=True, max_param="max_tokens")
    assert (error.status, error.param) == (400, "tool_choice")
    assert error.message == f"tool_choice {caught.value.detail}"
    reply = frontend.on_client_frames([b"zmq", msgspec.msgpack.encode(req)]).replies[0][1]
    assert reply.error == str(caught.value), "the ZMQ door answers the same refusal"


def test_a_forced_grammar_fault_in_validation_is_tool_choices(frontend: Frontend) -> None:
    req = _chat("required", sampling=SamplingParams(ignore_eos=True))
    with pytest.raises(RequestRejected) as caught:
        asyncio.run(frontend.admit(b"http-1", req))
    assert caught.value.param == "tool_choice" and "(forced call)" in caught.value.detail


def test_both_doors_start_the_same_request(frontend: Frontend) -> None:
    """ZMQ: compiled off the loop (Outbox.to_compile), then started; HTTP: admitted in one await."""
    req = _chat("required", rid="both")
    first = frontend.on_client_frames([b"zmq", msgspec.msgpack.encode(req)])
    assert first.to_compile and not first.to_scheduler, "compiled before it starts"
    (by_zmq,) = asyncio.run(frontend.admit_after_compile(first.to_compile[0])).to_scheduler
    (by_http,) = asyncio.run(frontend.admit(b"http-2", req)).to_scheduler
    assert isinstance(by_zmq, TokenizedRequest) and isinstance(by_http, TokenizedRequest)
    assert by_zmq.sampler.grammar is not None and by_zmq.sampler.grammar == by_http.sampler.grammar
    assert by_zmq.input_ids == by_http.input_ids and by_zmq.max_new_tokens == by_http.max_new_tokens
    again = frontend.on_client_frames([b"zmq-2", msgspec.msgpack.encode(req)])
    assert len(again.to_scheduler) == 1 and not again.to_compile, "its grammar is cached now"
