"""Tools and tool history in the prompt (SmolLM2's real template, and a Qwen3-style one that takes
tools itself), the checks that name the bad field, and the grammar that forces a call."""

from __future__ import annotations

import copy
import importlib.util
import json
import random
from typing import TYPE_CHECKING, Any

import jsonschema
import msgspec
import pytest

from protocol.chat import ChatMessage, NamedFunction, NamedToolChoice, Tool, ToolChoice
from protocol.grammar import Grammar
from protocol.messages import GenerateRequest, SamplingParams
from tests.tokenizer_proc.chat.qwen3_style import QWEN3_STYLE_TEMPLATE
from tokenizer_proc.chat.template import render_chat, template_traits
from tokenizer_proc.chat.tool_checks import forced_call_grammar, with_tool_grammar
from tokenizer_proc.grammar import GrammarCompiler
from tokenizer_proc.model_info import ModelInfo
from tokenizer_proc.validation import RequestRejected, validate_generate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS = msgspec.convert(
    [
        {
            "type": "function",
            "function": {"name": "add", "description": "Add two integers.", "parameters": ADD},
        },
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
    ],
    list[Tool],
)
HISTORY = msgspec.convert(
    [
        {"role": "user", "content": "What is 1 + 2, and the time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ],
    list[ChatMessage],
)  # fmt: skip
USER = [ChatMessage(role="user", content="Add 1 and 2.")]


def _chat(messages: list[ChatMessage], tool_choice: ToolChoice = "auto", **kw: Any) -> GenerateRequest:
    return GenerateRequest(rid="r", messages=messages, tools=TOOLS, tool_choice=tool_choice, **kw)


@pytest.fixture(scope="module")
def qwen3_style(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = QWEN3_STYLE_TEMPLATE
    return tok


def test_smollm2_template_ignores_tools(tokenizer: PreTrainedTokenizerBase) -> None:
    traits = template_traits(tokenizer)
    assert (traits.takes_tools, traits.takes_tool_calls, traits.tool_format, traits.thinks) == (
        False, False, "hermes", False,
    )  # fmt: skip


def test_tools_go_into_a_new_system_message(tokenizer: PreTrainedTokenizerBase) -> None:
    text, plan = render_chat(_chat(USER), tokenizer, template_traits(tokenizer))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou can call functions.")
    assert "named SmolLM" not in text  # our system turn replaces the template's default one
    assert json.dumps({"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                                         "parameters": ADD}}) in system  # fmt: skip
    assert "<tools>" in system and "<tool_call>" in system and text.count("<|im_start|>system") == 1
    assert (plan.tool_format, plan.tool_names, plan.reasoning) == ("hermes", frozenset({"add", "now"}), False)


def test_tools_merge_into_the_clients_system_message(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [ChatMessage(role="system", content="Be brief."), *USER]
    text, _ = render_chat(_chat(messages), tokenizer, template_traits(tokenizer))
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions.")
    assert text.count("<|im_start|>system") == 1 and '"name": "now"' in text


def test_tool_choice_none_offers_no_tools(tokenizer: PreTrainedTokenizerBase) -> None:
    text, plan = render_chat(_chat(USER, "none"), tokenizer, template_traits(tokenizer))
    assert "<tools>" not in text and plan.tool_format is None


def test_tool_history_renders_as_text_in_smollm2s_template(tokenizer: PreTrainedTokenizerBase) -> None:
    text, _ = render_chat(_chat(HISTORY), tokenizer, template_traits(tokenizer))
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        in text
    )
    assert '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>' in text
    # both results in one user turn, so templates that want alternating turns still get them
    assert (
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\nnoon\n</tool_response><|im_end|>"
        in text
    )
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_that_takes_tools_renders_them_itself(qwen3_style: PreTrainedTokenizerBase) -> None:
    traits = template_traits(qwen3_style)
    assert (traits.takes_tools, traits.takes_tool_calls, traits.thinks) == (True, True, True)
    text, plan = render_chat(_chat(HISTORY), qwen3_style, traits)
    assert "# Tools" in text and "You can call functions" not in text
    assert '{"name": "add", "arguments": {"a": 1, "b": 2}}' in text  # arguments passed as a mapping
    assert "<|im_start|>user\n<tool_response>\nnoon\n</tool_response>" in text
    assert plan.reasoning and plan.starts_in_reasoning  # the prompt ends with an open <think>


def test_chat_template_kwargs_reach_the_template(qwen3_style: PreTrainedTokenizerBase) -> None:
    req = GenerateRequest(rid="r", messages=USER, chat_template_kwargs={"enable_thinking": False})
    text, plan = render_chat(req, qwen3_style, template_traits(qwen3_style))
    assert text.endswith("<think>\n\n</think>\n\n")
    assert plan.reasoning and not plan.starts_in_reasoning and plan.tool_format is None


@pytest.mark.parametrize(
    ("req", "param"),
    [
        (_chat(USER, NamedToolChoice(function=NamedFunction(name="mul"))), "tool_choice"),
        (GenerateRequest(rid="r", messages=USER, tool_choice="required"), "tool_choice"),
        (_chat([*USER, ChatMessage(role="tool", content="3")]), "messages[1].tool_call_id"),
        (_chat([ChatMessage(role="user")]), "messages[0].content"),
        (_chat(USER, chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs"),
        (GenerateRequest(rid="r", prompt="hi", tools=TOOLS), "tools"),
        (
            GenerateRequest(rid="r", messages=USER, tools=[*TOOLS, TOOLS[0]]),
            "tools[2].function.name",
        ),
    ],
)
def test_bad_tool_requests_name_the_field(
    req: GenerateRequest, param: str, tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo
) -> None:
    with pytest.raises(RequestRejected) as caught:
        validate_generate(req, tokenizer, model_info, random.Random(0))
    assert caught.value.param == param


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


def test_named_choice_grammar_is_the_schema_of_one_call() -> None:
    grammar = forced_call_grammar(TOOLS, NamedToolChoice(function=NamedFunction(name="add")))
    assert grammar is not None and grammar.kind == "json_schema"
    schema = json.loads(grammar.spec)
    jsonschema.validate(_call("add", {"a": 1, "b": 2}), schema)
    for wrong in (
        _call("now", {}),
        _call("add", {"a": 1}),
        _call("add", {"a": "1", "b": 2}),
        {"name": "add"},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_required_grammar_allows_any_offered_tool_and_auto_none_have_none() -> None:
    grammar = forced_call_grammar(TOOLS, "required")
    assert grammar is not None
    schema = json.loads(grammar.spec)
    jsonschema.validate(_call("add", {"a": 1, "b": 2}), schema)
    jsonschema.validate(_call("now", {}), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(_call("mul", {}), schema)
    assert forced_call_grammar(TOOLS, "auto") is None and forced_call_grammar(TOOLS, "none") is None


@pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None, reason="xgrammar is not installed")
@pytest.mark.parametrize("choice", ["required", NamedToolChoice(function=NamedFunction(name="add"))])
def test_forced_call_grammar_compiles_with_xgrammar(choice: ToolChoice) -> None:
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    grammar = forced_call_grammar(TOOLS, choice)
    assert grammar is not None
    # as xgrammar reads schemas by default, and as constrained decoding compiles them (no free
    # whitespace, strict: no property the schema does not list)
    for compiled in (
        xgrammar.Grammar.from_json_schema(grammar.spec),
        xgrammar.Grammar.from_json_schema(grammar.spec, any_whitespace=False, strict_mode=True),
    ):
        assert _is_grammar_accept_string(compiled, json.dumps(_call("add", {"a": 1, "b": 2})))
        assert not _is_grammar_accept_string(compiled, json.dumps(_call("add", {"a": 1})))
        assert not _is_grammar_accept_string(compiled, json.dumps(_call("mul", {"a": 1, "b": 2})))
        assert not _is_grammar_accept_string(compiled, json.dumps({**_call("add", {"a": 1, "b": 2}), "x": 1}))


def test_a_forced_choice_validates_with_its_compiled_grammar_and_parses_a_bare_call(
    tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo
) -> None:
    """``required``: the request carries the call's grammar (set where it enters), validation takes
    it compiled, and the reply is parsed as a bare JSON call."""
    req = with_tool_grammar(_chat(USER, "required"))
    assert req.sampling.grammar is not None and req.sampling.grammar.kind == "json_schema"
    compiler = GrammarCompiler(tokenizer, model_info.vocab_size)
    try:
        spec = compiler.compile_blocking(req.sampling.grammar)
        valid = validate_generate(req, tokenizer, model_info, random.Random(0), spec)
    finally:
        compiler.close()
    assert valid.chat_output is not None and valid.chat_output.tool_format == "json"
    assert valid.sampler.grammar is not None


LLAMA3_STYLE_TEMPLATE = (
    "{%- for m in messages %}"
    "{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- endfor %}{%- if tools %}{{ '<|start_header_id|>user<|end_header_id|>\\n\\nFunctions:' }}"
    "{%- for t in tools %}{{ '\\n' + (t | tojson) }}{%- endfor %}"
    '{{ \'\\nAnswer with {"name": function name, "parameters": arguments}\' }}'
    "{{ ', or <|python_tag|> code.<|eot_id|>' }}"
    "{%- endif %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
)


def test_a_llama3_style_template_picks_the_json_parser(tokenizer: PreTrainedTokenizerBase) -> None:
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = LLAMA3_STYLE_TEMPLATE
    traits = template_traits(tok)
    assert (traits.takes_tools, traits.tool_format, traits.thinks) == (True, "json", False)
    text, plan = render_chat(_chat(USER), tok, traits)
    assert "Functions:" in text and '"name": "add"' in text and plan.tool_format == "json"


def test_plain_messages_render_exactly_as_the_template_does(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [
        ChatMessage(role="system", content="\nBe brief.\n"),
        ChatMessage(role="user", content="Hi\n\n"),
    ]
    text, plan = render_chat(
        GenerateRequest(rid="r", messages=messages), tokenizer, template_traits(tokenizer)
    )
    plain = [{"role": m.role, "content": m.content or ""} for m in messages]
    assert text == tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    assert plan.tool_format is None and not plan.reasoning


def test_with_tool_grammar_fills_the_forced_grammar_once() -> None:
    req = _chat(USER, "required")
    filled = with_tool_grammar(req)
    assert filled.sampling.grammar == forced_call_grammar(TOOLS, "required") is not None
    assert with_tool_grammar(filled) == filled and with_tool_grammar(_chat(USER)) == _chat(USER)
    other = msgspec.structs.replace(req, sampling=SamplingParams(grammar=Grammar(kind="json_object")))
    assert with_tool_grammar(other).sampling.grammar == filled.sampling.grammar, "the forced call wins"


def test_a_forced_call_is_not_read_as_reasoning(qwen3_style: PreTrainedTokenizerBase) -> None:
    _, plan = render_chat(_chat(USER, "required"), qwen3_style, template_traits(qwen3_style))
    assert (plan.tool_format, plan.reasoning, plan.starts_in_reasoning) == ("json", False, False)
    _, free = render_chat(_chat(USER, "auto"), qwen3_style, template_traits(qwen3_style))
    assert (free.tool_format, free.reasoning, free.starts_in_reasoning) == ("hermes", True, True)
