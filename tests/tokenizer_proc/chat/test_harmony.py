"""The harmony parser on recorded gpt-oss replies, through a real tokenizer with harmony's markers:
each reply parsed whole and token by token, the streamed pieces adding up to the whole."""

from __future__ import annotations

import itertools
import json
from typing import TYPE_CHECKING

import pytest

from tests.tokenizer_proc.chat.harmony_style import harmony_tokenizer
from tokenizer_proc.chat.harmony import HarmonyParser, parse_header
from tokenizer_proc.chat.harmony_tokens import HarmonyTokens, harmony_tokens
from tokenizer_proc.chat.output import ChatPiece, merge_calls

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOOLS = frozenset({"get_weather", "get_time"})
REASONING_THEN_CALL = (
    "<|channel|>analysis<|message|>Need the weather for Paris, café ☕ aside.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris", "unit": "c"}<|call|>'
)
TWO_CALLS = (
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    '<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"tz": "CET"}'
    "<|call|>"
)
REASONING_THEN_FINAL = (
    "<|channel|>analysis<|message|>A greeting; answer briefly.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello there, how can I help?<|return|>"
)


@pytest.fixture(scope="module")
def harmony_tok(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    return harmony_tokenizer(tokenizer)


@pytest.fixture(scope="module")
def markers(harmony_tok: PreTrainedTokenizerBase) -> HarmonyTokens:
    found = harmony_tokens(harmony_tok)
    assert found is not None
    return found


def _parse(
    tok: PreTrainedTokenizerBase,
    markers: HarmonyTokens,
    reply: str,
    step: int | None,
    first_only: bool = False,
) -> list[ChatPiece]:
    """``reply``'s pieces, fed ``step`` tokens at a time (None: whole), the last one final."""
    ids = tok.encode(reply, add_special_tokens=False)
    counter = itertools.count()
    parser = HarmonyParser(markers, tok, TOOLS, lambda: f"call_{next(counter)}", first_only)
    if step is None:
        return [parser.feed(final=True, ids=ids)]
    chunks = [ids[i : i + step] for i in range(0, len(ids), step)]
    return [parser.feed(final=i == len(chunks) - 1, ids=c) for i, c in enumerate(chunks)]


def _summed(pieces: list[ChatPiece]) -> tuple[str, str, list[tuple[str | None, str]]]:
    calls = merge_calls([c for p in pieces for c in p.tool_calls])
    content = "".join(p.content for p in pieces)
    return content, "".join(p.reasoning for p in pieces), [(c.name, c.arguments) for c in calls]


def _both(
    tok: PreTrainedTokenizerBase, markers: HarmonyTokens, reply: str, first_only: bool = False
) -> tuple[str, str, list[tuple[str | None, str]]]:
    """The whole reply's parse, checked equal to its parse token by token and 3 tokens at a time."""
    whole = _summed(_parse(tok, markers, reply, None, first_only))
    for step in (1, 3):
        assert _summed(_parse(tok, markers, reply, step, first_only)) == whole, f"step {step}"
    return whole


def test_the_markers_are_found_only_when_all_are_there(
    tokenizer: PreTrainedTokenizerBase, markers: HarmonyTokens
) -> None:
    assert harmony_tokens(tokenizer) is None
    assert sorted(markers.by_id.values()) == sorted(
        ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
    )


def test_reasoning_then_a_tool_call(harmony_tok: PreTrainedTokenizerBase, markers: HarmonyTokens) -> None:
    content, reasoning, calls = _both(harmony_tok, markers, REASONING_THEN_CALL)
    assert (content, reasoning) == ("", "Need the weather for Paris, café ☕ aside.")
    assert [(name, json.loads(args)) for name, args in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"})
    ]


def test_the_call_streams_its_name_first_then_its_arguments(
    harmony_tok: PreTrainedTokenizerBase, markers: HarmonyTokens
) -> None:
    pieces = _parse(harmony_tok, markers, REASONING_THEN_CALL, 1)
    deltas = [c for p in pieces for c in p.tool_calls]
    assert (deltas[0].id, deltas[0].name, deltas[0].arguments) == ("call_0", "get_weather", "")
    assert all(d.id is None and d.name is None for d in deltas[1:]) and len(deltas) > 3
    assert sum(1 for p in pieces if p.reasoning) > 3  # reasoning streams token by token


def test_two_tool_calls(harmony_tok: PreTrainedTokenizerBase, markers: HarmonyTokens) -> None:
    assert _both(harmony_tok, markers, TWO_CALLS) == (
        "",
        "",
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')],
    )


def test_parallel_calls_off_keeps_the_first(
    harmony_tok: PreTrainedTokenizerBase, markers: HarmonyTokens
) -> None:
    assert _both(harmony_tok, markers, TWO_CALLS, first_only=True) == (
        "",
        "",
        [("get_weather", '{"city": "Paris"}')],
    )


def test_reasoning_then_final(harmony_tok: PreTrainedTokenizerBase, markers: HarmonyTokens) -> None:
    assert _both(harmony_tok, markers, REASONING_THEN_FINAL) == (
        "Hello there, how can I help?",
        "A greeting; answer briefly.",
        [],
    )


@pytest.mark.parametrize(
    ("cut", "expected"),
    [
        ("<|channel|>analysis<|message|>Still thinking about", ("", "Still thinking about", [])),
        (REASONING_THEN_FINAL[:-len("help?<|return|>")],
         ("Hello there, how can I ", "A greeting; answer briefly.", [])),
        (REASONING_THEN_CALL[: REASONING_THEN_CALL.index('"unit"')],
         ("", "Need the weather for Paris, café ☕ aside.", [("get_weather", '{"city": "Paris", ')])),
        ("<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>fin", ("", "Done.", [])),
    ],
)  # fmt: skip
def test_a_stream_cut_mid_channel_gives_out_what_it_held(
    harmony_tok: PreTrainedTokenizerBase,
    markers: HarmonyTokens,
    cut: str,
    expected: tuple[str, str, list[tuple[str, str]]],
) -> None:
    assert _both(harmony_tok, markers, cut) == expected


def test_a_recipient_before_the_channel(harmony_tok: PreTrainedTokenizerBase, markers: HarmonyTokens) -> None:
    """The form gpt-oss's template renders past calls in (and the model sometimes writes)."""
    reply = ' to=functions.get_time<|channel|>commentary json<|message|>{"tz": "UTC"}<|call|>'
    assert _both(harmony_tok, markers, reply) == ("", "", [("get_time", '{"tz": "UTC"}')])


def test_a_call_to_a_tool_not_offered_is_no_call(
    harmony_tok: PreTrainedTokenizerBase, markers: HarmonyTokens
) -> None:
    reply = '<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{"path": "/"}<|call|>'
    assert _both(harmony_tok, markers, reply) == ('{"path": "/"}', "", [])


def test_a_preamble_is_content(harmony_tok: PreTrainedTokenizerBase, markers: HarmonyTokens) -> None:
    reply = "<|channel|>commentary<|message|>Let me check.<|end|>"
    reply += "<|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    assert _both(harmony_tok, markers, reply) == ("Let me check.Done.", "", [])


def test_a_reply_without_harmony_markup_is_content(
    harmony_tok: PreTrainedTokenizerBase, markers: HarmonyTokens
) -> None:
    """What a grammar that forces bare JSON from the first token makes the model write."""
    assert _both(harmony_tok, markers, '{"answer": 42}') == ('{"answer": 42}', "", [])


def test_a_reply_that_only_looks_like_a_recipient_is_content(
    harmony_tok: PreTrainedTokenizerBase, markers: HarmonyTokens
) -> None:
    """A reply opening with " to" waits for a marker to tell a header; none came: it was prose."""
    assert _both(harmony_tok, markers, " to be or not to be") == (" to be or not to be", "", [])


def test_header_fields() -> None:
    header = parse_header("assistant<|channel|>commentary to=functions.f <|constrain|>json")
    assert (header.channel, header.recipient, header.constraint) == ("commentary", "functions.f", "json")
    assert parse_header("<|channel|>final").recipient is None
