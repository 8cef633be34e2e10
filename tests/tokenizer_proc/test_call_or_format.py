"""The one grammar of "tool calls in the model's syntax, or text in the format" (tools offered with
tool_choice auto beside a response_format): what it accepts, and where a fault of it points."""

from __future__ import annotations

import json

import msgspec
import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string as accepts

from protocol.chat import ChatMessage, Tool, ToolChoice
from protocol.grammar import Grammar
from protocol.messages import GenerateRequest, SamplingParams
from tokenizer_proc.chat.tool_checks import call_schema, with_tool_grammar
from tokenizer_proc.grammar import call_or_format_grammar
from tokenizer_proc.validation_error import RequestRejected

COLOUR = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"]}
TOOLS = msgspec.convert(
    [{"function": {"name": n, "parameters": COLOUR}} for n in ("pick", "stop")], list[Tool]
)
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
ANSWER = Grammar(kind="json_schema", spec=json.dumps(ANSWER_SCHEMA))
PICK_CALL = '{"name": "pick", "arguments": {"colour": "red"}}'
STOP_CALL = '{"name": "stop", "arguments": {"colour": "blue"}}'


def _grammar(tool_format: str, parallel: bool, text_format: Grammar = ANSWER) -> xgrammar.Grammar:
    calls = tuple((i, json.dumps(call_schema(t))) for i, t in enumerate(TOOLS))
    built = call_or_format_grammar(text_format, calls, tool_format, parallel)
    assert built.kind == "ebnf", "it travels and is cached as any grammar"
    return xgrammar.Grammar.from_ebnf(built.spec)


def test_hermes_calls_or_the_format() -> None:
    grammar = _grammar("hermes", parallel=True)
    block = "<tool_call>\n{}\n</tool_call>"
    assert accepts(grammar, '{"answer": "yes"}')
    assert accepts(grammar, block.format(PICK_CALL))
    assert accepts(grammar, block.format(PICK_CALL) + "\n" + block.format(STOP_CALL))
    unknown_tool = block.format('{"name": "fly", "arguments": {}}')
    no_arguments = block.format('{"name": "pick"}')
    text_then_call = '{"answer": "yes"}' + block.format(PICK_CALL)
    for refused in ("plain text", '{"answer": "maybe"}', unknown_tool, text_then_call, no_arguments):
        assert not accepts(grammar, refused), refused
    single = _grammar("hermes", parallel=False)
    assert accepts(single, block.format(PICK_CALL))
    assert not accepts(single, block.format(PICK_CALL) + "\n" + block.format(STOP_CALL))


def test_json_calls_or_the_format() -> None:
    grammar = _grammar("json", parallel=True, text_format=Grammar(kind="regex", spec="(yes|no)"))
    assert accepts(grammar, PICK_CALL) and accepts(grammar, f"{PICK_CALL}; {STOP_CALL}")
    assert accepts(grammar, "no") and not accepts(grammar, "maybe")
    assert not accepts(_grammar("json", parallel=False), f"{PICK_CALL}; {STOP_CALL}")


def _chat(choice: ToolChoice, grammar: Grammar | None) -> GenerateRequest:
    return GenerateRequest(
        rid="r", messages=[ChatMessage(role="user", content="hi")], tools=TOOLS, tool_choice=choice,
        sampling=SamplingParams(grammar=grammar),
    )  # fmt: skip


def test_auto_tools_beside_a_format_get_the_union_and_nothing_else_does() -> None:
    union = with_tool_grammar(_chat("auto", ANSWER), "hermes").sampling.grammar
    assert union is not None and union.kind == "ebnf" and "tool_call" in union.spec
    assert with_tool_grammar(_chat("none", ANSWER)).sampling.grammar == ANSWER, "no tools offered"
    assert with_tool_grammar(_chat("auto", None)).sampling.grammar is None, "free text and calls"


@pytest.mark.parametrize(
    ("grammar", "tools", "param"),
    [
        (Grammar(kind="regex", spec="(unclosed"), TOOLS, "sampling.grammar"),
        (ANSWER, [TOOLS[0], msgspec.convert({"function": {"name": "bad", "parameters": {
            "type": "object", "properties": {"x": {"type": "frobnicate"}}}}}, Tool)],
         "tools[1].function.parameters"),
    ],
)  # fmt: skip
def test_a_fault_names_the_format_or_the_tool(grammar: Grammar, tools: list[Tool], param: str) -> None:
    req = msgspec.structs.replace(_chat("auto", grammar), tools=tools)
    with pytest.raises(RequestRejected) as caught:
        with_tool_grammar(req)
    assert caught.value.param == param and "cannot be compiled" in caught.value.detail
