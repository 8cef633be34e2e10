"""A harmony model's chat requests through the tokenizer's Frontend (its real tokenizer with
harmony's markers, a gpt-oss-style template, no model): the prompt as the template renders it
(tools, developer message, effort, calls and results), the grammars of forced calls, and crafted
replies parsed into reasoning, content and tool calls, streamed and whole."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import TYPE_CHECKING, Any

import msgspec
import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string as accepts

from protocol.chat import ChatMessage, NamedFunction, NamedToolChoice, Tool
from protocol.grammar import Grammar
from protocol.messages import (
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    SamplingParams,
    TokenBatch,
    TokenizedRequest,
)
from tests.tokenizer_proc.chat.harmony_style import harmony_tokenizer
from tokenizer_proc.chat.harmony_prompt import harmony_call_or_format, harmony_turns
from tokenizer_proc.chat.harmony_tokens import harmony_tokens
from tokenizer_proc.chat.output import merge_calls
from tokenizer_proc.chat.template import render_chat, template_traits
from tokenizer_proc.chat.tool_checks import forced_call_grammar
from tokenizer_proc.frontend import Frontend
from tokenizer_proc.http.responses_input import input_messages
from tokenizer_proc.model_info import ModelInfo

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CLIENT = b"c"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = msgspec.convert(
    [
        {"type": "function",
         "function": {"name": "get_weather", "description": "Weather now.", "parameters": WEATHER}},
        {"type": "function",
         "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
    ],
    list[Tool],
)  # fmt: skip
USER = [
    ChatMessage(role="system", content="Be brief."),
    ChatMessage(role="user", content="Weather in Paris?"),
]
HISTORY = msgspec.convert(
    [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "function": {"name": "get_time", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ],
    list[ChatMessage],
)  # fmt: skip
CALL = (
    "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris"}<|call|>'
)
FINAL = (
    "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"
)


@pytest.fixture(scope="module")
def harmony_tok(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    return harmony_tokenizer(tokenizer)


@pytest.fixture(scope="module")
def frontend(harmony_tok: PreTrainedTokenizerBase, model_info: ModelInfo) -> Frontend:
    markers = harmony_tokens(harmony_tok)
    assert markers is not None
    ends = markers.ends
    info = dataclasses.replace(model_info, vocab_size=len(harmony_tok), eos_token_ids=ends)
    return Frontend(harmony_tok, info, seed=0)


def _render(tok: PreTrainedTokenizerBase, req: GenerateRequest) -> str:
    text, plan = render_chat(req, tok, template_traits(tok))
    assert plan.harmony is not None and plan.reasoning
    return text


def test_the_prompt_is_the_templates_with_tools_instructions_and_effort(
    harmony_tok: PreTrainedTokenizerBase,
) -> None:
    req = GenerateRequest(
        rid="r", messages=USER, tools=TOOLS, chat_template_kwargs={"reasoning_effort": "xhigh"}
    )
    text = _render(harmony_tok, req)
    assert "Reasoning: high\n" in text  # OpenAI's xhigh as the nearest effort gpt-oss knows
    assert "# Instructions\n\nBe brief." in text
    assert "// Weather now.\ntype get_weather = (_: {\ncity: string,\n}) => any;" in text
    assert "type get_time = (_: {\n}) => any;" in text  # as openai-harmony renders an empty object
    assert text.endswith("<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant")


def test_parallel_calls_are_rendered_one_a_message_each_before_its_result(
    harmony_tok: PreTrainedTokenizerBase,
) -> None:
    text = _render(harmony_tok, GenerateRequest(rid="r", messages=HISTORY, tools=TOOLS))
    turns = text.split("<|start|>")[-5:]
    assert turns == [
        'assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
        'functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>',
        "assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>",
        'functions.get_time to=assistant<|channel|>commentary<|message|>"noon"<|end|>',
        "assistant",
    ]
    assert [m.role for m in harmony_turns(HISTORY)] == ["user", "assistant", "tool", "assistant", "tool"]


def test_reasoning_sent_back_is_shown_before_the_call(harmony_tok: PreTrainedTokenizerBase) -> None:
    """gpt-oss reasons across its calls: a call's reasoning (chat's reasoning_content, a Responses
    reasoning item) is rendered as its analysis message; a turn's content joins it."""
    said = msgspec.structs.replace(HISTORY[1], reasoning="I need both.", content="Checking.")
    text = _render(
        harmony_tok, GenerateRequest(rid="r", messages=[HISTORY[0], said, *HISTORY[2:]], tools=TOOLS)
    )
    analysis = "<|start|>assistant<|channel|>analysis<|message|>I need both.\n\nChecking.<|end|>"
    assert analysis + "<|start|>assistant to=functions.get_weather" in text
    assert text.count("<|channel|>analysis") == 1  # only before the first of the turn's calls
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": "Weather?"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "I need it."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    messages = input_messages(items)
    assert [(m.role, m.reasoning) for m in messages] == [
        ("user", None),
        ("assistant", "I need it."),
        ("tool", None),
    ]


def _grammar_accepts(tok: PreTrainedTokenizerBase, grammar: Grammar, text: str) -> bool:
    return bool(accepts(xgrammar.Grammar.from_ebnf(grammar.spec), text))


def test_a_forced_call_is_a_grammar_of_harmonys_call_message(harmony_tok: PreTrainedTokenizerBase) -> None:
    named = NamedToolChoice(function=NamedFunction(name="get_weather"))
    grammar = forced_call_grammar(TOOLS, named, "harmony")
    assert grammar is not None
    header = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    assert _grammar_accepts(harmony_tok, grammar, header + '{"city": "Paris"}')
    analysis = "<|channel|>analysis<|message|>I need the weather.<|end|><|start|>assistant"
    assert _grammar_accepts(harmony_tok, grammar, analysis + header + '{"city": "Paris"}')
    assert not _grammar_accepts(harmony_tok, grammar, analysis)
    assert not _grammar_accepts(harmony_tok, grammar, header + '{"town": "Paris"}')
    assert not _grammar_accepts(
        harmony_tok, grammar, '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    )
    required = forced_call_grammar(TOOLS, "required", "harmony")
    assert required is not None
    assert _grammar_accepts(harmony_tok, required, header.replace("get_weather", "get_time") + "{}")


def test_calls_beside_a_format_are_a_call_message_or_the_bare_format(
    harmony_tok: PreTrainedTokenizerBase,
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    answer = Grammar(kind="json_schema", spec=json.dumps(schema))
    grammar = harmony_call_or_format(answer, TOOLS)
    assert _grammar_accepts(harmony_tok, grammar, '{"a": 1}')
    assert _grammar_accepts(
        harmony_tok, grammar, "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}"
    )
    assert not _grammar_accepts(harmony_tok, grammar, "free text")


def _reply(frontend: Frontend, output: str, stream: bool, rid: str, **fields: Any) -> list[GenerateOutput]:
    """Run a chat request whose model writes ``output``, one token per step; its replies."""
    req = GenerateRequest(rid=rid, messages=USER, stream=stream, **fields)
    out = asyncio.run(frontend.admit(CLIENT, req))
    (sent,) = out.to_scheduler
    assert isinstance(sent, TokenizedRequest)
    ids = frontend.tokenizer.encode(output, add_special_tokens=False)
    assert ids[-1] in sent.stop_token_ids, "the reply ends at an end id of harmony's"
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
    stream = _reply(frontend, output, True, "stream", **fields)
    calls = merge_calls([c for p in stream for c in p.tool_calls or []])
    whole_calls = [(c.name, c.arguments) for c in whole.tool_calls or []]
    assert "".join(p.text for p in stream) == whole.text
    assert "".join(p.reasoning_text for p in stream) == whole.reasoning_text
    assert [(c.name, c.arguments) for c in calls] == whole_calls
    assert stream[-1].finish_reason is whole.finish_reason
    return whole, stream


def test_reasoning_and_a_tool_call(frontend: Frontend) -> None:
    whole, stream = _both(frontend, CALL, tools=TOOLS)
    assert (whole.reasoning_text, whole.text) == ("The user wants the weather.", "")
    assert [(c.name, c.arguments) for c in whole.tool_calls or []] == [("get_weather", '{"city": "Paris"}')]
    assert whole.finish_reason is FinishReason.TOOL_CALLS
    assert sum(1 for p in stream if p.reasoning_text) > 2  # streamed token by token


def test_reasoning_and_a_final_answer(frontend: Frontend) -> None:
    whole, _ = _both(frontend, FINAL, tools=TOOLS)
    assert (whole.reasoning_text, whole.text, whole.tool_calls) == ("Easy.", "Sunny.", None)
    assert whole.finish_reason is FinishReason.STOP


def test_without_tools_a_call_message_is_content(frontend: Frontend) -> None:
    whole, _ = _both(frontend, CALL)
    assert (whole.text, whole.tool_calls, whole.finish_reason) == (
        '{"city": "Paris"}',
        None,
        FinishReason.STOP,
    )


def test_a_forced_call_is_admitted_with_its_grammar(frontend: Frontend) -> None:
    named = NamedToolChoice(function=NamedFunction(name="get_weather"))
    call = CALL[CALL.index("<|start|>assistant") + len("<|start|>assistant") :]
    whole, _ = _both(
        frontend, call, tools=TOOLS, tool_choice=named, sampling=SamplingParams(max_new_tokens=32)
    )
    assert [(c.name, c.arguments) for c in whole.tool_calls or []] == [("get_weather", '{"city": "Paris"}')]
