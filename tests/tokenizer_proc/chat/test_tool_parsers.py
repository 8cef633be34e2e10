"""The tool-call and reasoning parsers: what they find, and that any split of the text into
pieces (streaming) gives exactly what the whole text gives, including splits inside tags."""

from __future__ import annotations

import json
import random

import pytest

from protocol.chat import ToolCallDelta
from tokenizer_proc.chat.output import ChatOutputParser, merge_calls
from tokenizer_proc.chat.reasoning import ReasoningSplitter
from tokenizer_proc.chat.template import ChatOutputPlan
from tokenizer_proc.chat.tool_parsers import ToolCallParser, ToolFormat

NAMES = {"get_weather", "add"}
Parsed = tuple[str, list[tuple[str | None, str | None, str]]]


def _parse(text: str, fmt: ToolFormat, cuts: list[int]) -> Parsed:
    ids = iter(range(100))
    parser = ToolCallParser(fmt, NAMES, lambda: f"call_{next(ids)}")
    content, pieces = "", list[ToolCallDelta]()
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        more, deltas = parser.feed(text[start:end])
        content, pieces = content + more, pieces + deltas
    more, deltas = parser.finish()
    calls = merge_calls(pieces + deltas)
    assert [c.index for c in calls] == list(range(len(calls))), "call indexes must count from 0"
    return content + more, [(c.id, c.name, c.arguments) for c in calls]


CASES: list[tuple[ToolFormat, str, str, list[tuple[str, dict[str, object]]]]] = [
    (
        "hermes",
        'Sure! <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}\n'
        '</tool_call>\n<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>',
        "Sure! ",
        [("get_weather", {"city": "Paris", "n": [1, {"a": "}"}]}), ("add", {"a": 1})],
    ),
    ("hermes", "Plain text with a <tool_ and < signs <", "Plain text with a <tool_ and < signs <", []),
    (
        "hermes",
        'x <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> y',
        'x <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> y',
        [],
    ),  # a name that is not offered: not a call
    ("hermes", '<tool_call>{"foo": 1}</tool_call>', '<tool_call>{"foo": 1}</tool_call>', []),
    ("hermes", "<tool_call>not json", "<tool_call>not json", []),
    ("hermes", '<tool_call>\n {"foo": 1}\n</tool_call>', '<tool_call>\n {"foo": 1}\n</tool_call>', []),
    ("hermes", "<tool_call>\n not json", "<tool_call>\n not json", []),
    (
        "hermes",
        '<tool_call>{"name": "add", "arguments": {"a": "\\"}\\\\"}}</tool_call>',
        "",
        [("add", {"a": '"}\\'})],
    ),
    ("json", '{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [("add", {"a": 1, "b": 2})]),
    (
        "json",
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "arguments": {}}',
        "",
        [("add", {"a": 1}), ("get_weather", {})],
    ),
    ("json", '  {"name": "add"}', "", [("add", {})]),
    ("json", 'The answer: {"name": "add"}', 'The answer: {"name": "add"}', []),
    ("json", '{"answer": 42}', '{"answer": 42}', []),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_parser_finds_the_calls(
    fmt: ToolFormat, text: str, content: str, calls: list[tuple[str, dict[str, object]]]
) -> None:
    got_content, got_calls = _parse(text, fmt, [])
    assert got_content == content
    assert [(name, json.loads(args)) for _, name, args in got_calls] == calls
    assert [call_id for call_id, _, _ in got_calls] == [f"call_{i}" for i in range(len(calls))]


@pytest.mark.parametrize(("fmt", "text"), [(c[0], c[1]) for c in CASES])
def test_every_two_cut_split_parses_like_the_whole(fmt: ToolFormat, text: str) -> None:
    whole = _parse(text, fmt, [])
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert _parse(text, fmt, [i, j]) == whole, (i, j)


def test_char_by_char_streams_arguments_in_pieces() -> None:
    text = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 22}}</tool_call>'
    parser = ToolCallParser("hermes", NAMES, lambda: "call_x")
    pieces: list[ToolCallDelta] = []
    for c in text:
        pieces += parser.feed(c)[1]
    pieces += parser.finish()[1]
    assert pieces[0].id == "call_x" and pieces[0].name == "add"
    assert all(p.id is None and p.name is None for p in pieces[1:]) and len(pieces) > 5
    assert "".join(p.arguments for p in pieces) == '{"a": 1, "b": 22}'


def test_truncated_call_keeps_what_was_written() -> None:
    assert _parse('<tool_call>{"name": "add", "arguments": {"a": 1', "hermes", []) == (
        "",
        [("call_0", "add", '{"a": 1')],
    )
    assert _parse('<tool_call>{"arguments": {"a": 1}', "hermes", []) == (
        '<tool_call>{"arguments": {"a": 1}',
        [],
    )


def _split(text: str, inside: bool, cuts: list[int]) -> tuple[str, str]:
    splitter = ReasoningSplitter(inside)
    reasoning, content = "", ""
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        r, c = splitter.feed(text[start:end])
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(
    ("text", "inside", "expected"),
    [
        ("<think>\nLet me see.\n</think>\n\nParis.", False, ("Let me see.\n", "Paris.")),
        ("  <think>a</think>b <think>c</think>", False, ("a", "b <think>c</think>")),
        ("Let me see.</think>Paris.", True, ("Let me see.", "Paris.")),
        ("Still thinking <", True, ("Still thinking <", "")),
        ("Paris.", False, ("", "Paris.")),
        ("<thin", False, ("", "<thin")),
    ],
)
def test_reasoning_split_on_every_two_cut_split(text: str, inside: bool, expected: tuple[str, str]) -> None:
    assert _split(text, inside, []) == expected
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert _split(text, inside, [i, j]) == expected, (i, j)


def test_chat_output_splits_reasoning_before_parsing_calls() -> None:
    plan = ChatOutputPlan(
        tool_format="hermes", tool_names=frozenset({"add"}), reasoning=True, starts_in_reasoning=True
    )
    text = 'I should add. <tool_call> is the tag.</think>\n<tool_call>{"name": "add", "arguments": {"a": 1}}'
    text += "</tool_call>"
    for cut in range(len(text) + 1):
        parser = ChatOutputParser(plan, new_id=lambda: "call_1")
        first, last = parser.feed(text[:cut], final=False), parser.feed(text[cut:], final=True)
        assert first.reasoning + last.reasoning == "I should add. <tool_call> is the tag."
        assert first.content + last.content == ""
        calls = merge_calls(first.tool_calls + last.tool_calls)
        assert [(c.id, c.name, c.arguments) for c in calls] == [("call_1", "add", '{"a": 1}')]
        assert parser.made_calls


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    """Two calls written: ``first_call_only`` gives the first, whole or at any cut; the second's
    text is not content. Without it both come."""
    call = '<tool_call>{{"name": "add", "arguments": {{"a": {}}}}}</tool_call>'
    text = "Sure. " + call.format(1) + " and " + call.format(2)
    ids = iter(range(10**4))
    for first_only, expected in [(True, ['{"a": 1}']), (False, ['{"a": 1}', '{"a": 2}'])]:
        plan = ChatOutputPlan(tool_format="hermes", tool_names=frozenset({"add"}), reasoning=False,
                              starts_in_reasoning=False, first_call_only=first_only)  # fmt: skip
        for cut in range(len(text) + 1):
            parser = ChatOutputParser(plan, new_id=lambda: f"call_{next(ids)}")
            first, last = parser.feed(text[:cut], final=False), parser.feed(text[cut:], final=True)
            calls = merge_calls(first.tool_calls + last.tool_calls)
            assert [c.arguments for c in calls] == expected, cut
            assert [c.index for c in calls] == list(range(len(expected)))
            assert first.content + last.content == "Sure. and ", cut  # the parser trims around calls


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "</tool", "<", "{", "}", "[", "]", '"', "\\", ":", ",", " ",
    "\n", '"name"', '"arguments"', '"parameters"', '"add"', '"get_weather"', '"x"', "1", "text",
    "<|python_tag|>", ";", '{"name": "add", "arguments": {"a": 1}}', "<think>", "</think>",
]  # fmt: skip


@pytest.mark.parametrize("fmt", ["hermes", "json"])
def test_random_texts_split_at_random_parse_like_the_whole(fmt: ToolFormat) -> None:
    rng = random.Random(18)
    for _ in range(400):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randrange(1, 14)))
        cuts = sorted(rng.randrange(len(text) + 1) for _ in range(rng.randrange(1, 6)))
        assert _parse(text, fmt, cuts) == _parse(text, fmt, []), (text, cuts)
        assert _split(text, False, cuts) == _split(text, False, []), (text, cuts)
        assert _split(text, True, cuts) == _split(text, True, []), (text, cuts)
