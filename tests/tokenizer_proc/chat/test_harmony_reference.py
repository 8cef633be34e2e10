"""Our harmony parser against OpenAI's own (``openai-harmony``'s StreamableParser) on gpt-oss's real
vocabulary, and our gpt-oss-style template against its renderer: run only where the package is
installed and its ``o200k_base`` vocabulary is at hand (``TIKTOKEN_ENCODINGS_BASE`` naming a folder
that holds ``o200k_base.tiktoken``), since the package would otherwise fetch it from the network.
Neither is a dependency of rivulet: the parser and the rendering work offline on the model's own
tokenizer and template."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.tokenizer_proc.chat.test_harmony import REASONING_THEN_CALL, REASONING_THEN_FINAL, TWO_CALLS
from tokenizer_proc.chat.harmony import HarmonyParser
from tokenizer_proc.chat.harmony_tokens import MARKERS, HarmonyTokens
from tokenizer_proc.chat.output import merge_calls

harmony = pytest.importorskip("openai_harmony")
_VOCAB = Path(os.environ.get("TIKTOKEN_ENCODINGS_BASE", "/nonexistent")) / "o200k_base.tiktoken"
pytestmark = pytest.mark.skipif(
    not _VOCAB.is_file(), reason="openai-harmony's o200k_base vocabulary is not at hand"
)


@pytest.fixture(scope="module")
def encoding() -> Any:
    return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


class _Decoder:
    """The encoding as the TokenDecoder our parser reads bodies and headers with."""

    def __init__(self, encoding: Any) -> None:
        self._encoding = encoding

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        kept = [t for t in token_ids if not (skip_special_tokens and self._encoding.is_special_token(t))]
        return str(self._encoding.decode(kept))


def _ours(encoding: Any, ids: Sequence[int]) -> tuple[str, str, list[tuple[str | None, str]]]:
    tokens = HarmonyTokens({encoding.encode(m, allowed_special="all")[0]: m for m in MARKERS})
    counter = itertools.count()
    parser = HarmonyParser(tokens, _Decoder(encoding), frozenset({"get_weather", "get_time"}),
                           lambda: f"call_{next(counter)}")  # fmt: skip
    pieces = [parser.feed(final=i == len(ids) - 1, ids=[t]) for i, t in enumerate(ids)]
    calls = merge_calls([c for p in pieces for c in p.tool_calls])
    return (
        "".join(p.content for p in pieces),
        "".join(p.reasoning for p in pieces),
        [(c.name, c.arguments) for c in calls],
    )


def _theirs(encoding: Any, ids: Sequence[int]) -> tuple[str, str, list[tuple[str | None, str]]]:
    parser = harmony.StreamableParser(encoding, role=harmony.Role.ASSISTANT)
    for token in ids:
        parser.process(token)
    content, reasoning, calls = "", "", []
    for message in parser.messages:
        text = "".join(part.text for part in message.content)
        if message.recipient and message.recipient.startswith("functions."):
            calls.append((message.recipient.removeprefix("functions."), text))
        elif message.channel == "analysis":
            reasoning += text
        else:
            content += text
    return content, reasoning, calls


@pytest.mark.parametrize("reply", [REASONING_THEN_CALL, TWO_CALLS, REASONING_THEN_FINAL])
def test_our_parser_reads_what_openais_reads(encoding: Any, reply: str) -> None:
    ids = encoding.encode(reply, allowed_special="all")
    assert _ours(encoding, ids) == _theirs(encoding, ids)


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "The city."},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city"],
}
TIME = {"type": "object", "properties": {}}


def test_the_template_renders_the_tools_as_openais_renderer(encoding: Any) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    from tests.tokenizer_proc.chat.harmony_style import GPT_OSS_STYLE_TEMPLATE

    described = [("get_weather", "The weather now.", WEATHER), ("get_time", "The time.", TIME)]
    tools = [harmony.ToolDescription.new(name, text, parameters=params) for name, text, params in described]
    developer = harmony.DeveloperContent.new().with_instructions("Be brief.").with_function_tools(tools)
    convo = harmony.Conversation.from_messages([
        harmony.Message.from_role_and_content(harmony.Role.DEVELOPER, developer),
        harmony.Message.from_role_and_content(harmony.Role.USER, "What time is it?"),
    ])  # fmt: skip
    theirs = encoding.decode(encoding.render_conversation_for_completion(convo, harmony.Role.ASSISTANT))
    tool_dicts: list[Any] = [
        {"type": "function", "function": {"name": name, "description": text, "parameters": params}}
        for name, text, params in described
    ]
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "What time is it?"},
    ]
    rendered: Any = render_jinja_template(
        [messages], tools=tool_dicts, chat_template=GPT_OSS_STYLE_TEMPLATE, add_generation_prompt=True
    )
    ours = rendered[0][0]  # (the rendered conversations, their generation indices)
    developer_on = "<|start|>developer<|message|>"
    assert ours[ours.index(developer_on) :] == theirs[theirs.index(developer_on) :]
