"""gpt-oss's harmony format -> content, reasoning and tool calls, parsed incrementally from the
reply's token ids (not its text: the format's markers are special tokens of the model's own
vocabulary, which a text decode drops, and a token id cannot be confused with prose).

A reply is a sequence of messages, ``<|start|>HEADER<|message|>BODY`` ended by ``<|end|>``,
``<|return|>`` (the last answer) or ``<|call|>`` (a tool call); the prompt already opened the first
with ``<|start|>assistant``. The header names the channel (``<|channel|>analysis``), maybe a
recipient (``to=functions.NAME``, before or after the channel) and a constraint
(``<|constrain|>json``). A body goes, as its tokens arrive:

- to a tool call when its recipient is ``functions.NAME`` of an offered tool (the call is announced,
  id and name, when the header ends; its body is the arguments' text, the model's own);
- to reasoning on the ``analysis`` channel;
- to content otherwise (``final``, and ``commentary`` without a recipient: the preambles gpt-oss
  writes for the user).

A reply that does not open with a header (a grammar forced bare JSON from the first token) is all
content. A reply cut anywhere (length, abort) gives out what its open body held; a header cut
before its ``<|message|>`` says nothing yet and is dropped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from protocol.chat import ToolCallDelta
from tokenizer_proc.chat.harmony_tokens import (
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    FUNCTIONS,
    MESSAGE,
    RETURN,
    START,
    HarmonyTokens,
)
from tokenizer_proc.chat.output import ChatPiece
from tokenizer_proc.detokenizer import IncrementalDetokenizer, TokenDecoder

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_WORD = re.compile(r"\s*([^\s<]+)")


@dataclass
class _Header:
    """A message's header as read so far: ordinary tokens between markers, decoded at its end."""

    parts: list[str | list[int]] = field(default_factory=list)

    def add(self, token: int | str) -> None:
        if isinstance(token, str):
            self.parts.append(token)
        elif self.parts and isinstance(self.parts[-1], list):
            self.parts[-1].append(token)
        else:
            self.parts.append([token])

    def text(self, decoder: TokenDecoder) -> str:
        out = []
        for part in self.parts:
            decoded = part if isinstance(part, str) else decoder.decode(part, skip_special_tokens=True)
            assert isinstance(decoded, str), "decoding one sequence gives one string"
            out.append(decoded)
        return "".join(out)


@dataclass(frozen=True)
class HarmonyHeader:
    channel: str | None
    recipient: str | None
    constraint: str | None


def parse_header(text: str) -> HarmonyHeader:
    """``assistant<|channel|>commentary to=functions.f <|constrain|>json`` -> its fields."""

    def word_after(marker: str) -> str | None:
        at = text.find(marker)
        found = _WORD.match(text, at + len(marker)) if at >= 0 else None
        return found.group(1) if found else None

    found = _RECIPIENT.search(text)
    recipient = found.group(1) if found else None
    return HarmonyHeader(word_after(CHANNEL), recipient, word_after(CONSTRAIN))


class _Where(Enum):
    FIRST = "first"  # nothing yet: a header (the prompt opened it) or a reply not in harmony
    HEADER = "header"
    BODY = "body"
    BETWEEN = "between"  # a message ended; the next begins with <|start|>
    PLAIN = "plain"  # no harmony markup: everything is content


class HarmonyParser:
    """``feed`` a reply's token ids as they come; get its content, reasoning and tool-call pieces.

    ``first_call_only`` (parallel_tool_calls false): calls after the first are read and dropped.
    """

    def __init__(
        self,
        tokens: HarmonyTokens,
        decoder: TokenDecoder,
        tool_names: frozenset[str],
        new_id: Callable[[], str],
        first_call_only: bool = False,
    ) -> None:
        self._tokens = tokens.by_id
        self._decoder = decoder
        self._tool_names = tool_names
        self._new_id = new_id
        self._first_call_only = first_call_only
        self._where = _Where.FIRST
        self._header = _Header()
        self._body: IncrementalDetokenizer | None = None
        self._sink = "content"  # where the open body goes: content, reasoning or call
        self._prose_header = False  # the reply opened with " to...", no marker yet: maybe prose
        self.calls = 0

    @property
    def made_calls(self) -> bool:
        return self.calls > 0

    def feed(self, text: str = "", *, final: bool, ids: Sequence[int] = ()) -> ChatPiece:
        """The next piece of the reply from its new token ids (``text``, their decode without the
        markers, is not read); ``final``: the reply ended, what the open body held comes out."""
        piece = ChatPiece()
        for token in ids:
            self._take(token, piece)
        if final:
            self._close_body(piece)
            if self._where is _Where.HEADER and self._prose_header:  # it was prose, not a recipient
                piece.content += self._header.text(self._decoder)
        if self._first_call_only:
            piece.tool_calls = [call for call in piece.tool_calls if call.index == 0]
        return piece

    def _take(self, token: int, piece: ChatPiece) -> None:
        marker = self._tokens.get(token)
        if self._where is _Where.FIRST:
            self._prose_header = marker is None and self._opens_header(token)
            self._where = _Where.HEADER if marker is not None or self._prose_header else _Where.PLAIN
            if self._where is _Where.PLAIN:
                self._open_body("content")
        elif marker is not None:  # any marker after the first token: the reply is harmony
            self._prose_header = False
        if self._where is _Where.PLAIN or (self._where is _Where.BODY and marker is None):
            self._to_body(token, piece)
        elif self._where is _Where.BODY:
            self._close_body(piece)
            self._after_body(marker)
        elif marker == START:
            self._where, self._header = _Where.HEADER, _Header()
        elif self._where is _Where.HEADER:
            if marker == MESSAGE:
                self._begin_body(piece)
            elif marker not in (END, RETURN, CALL):
                self._header.add(marker if marker is not None else token)
        # else: between messages, anything but <|start|> is noise the format has no place for

    def _opens_header(self, token: int) -> bool:
        """A reply's first ordinary token starts a header only as a recipient (`` to=...``)."""
        text = self._decoder.decode([token], skip_special_tokens=True)
        assert isinstance(text, str), "decoding one sequence gives one string"
        start = text.lstrip()
        return bool(start) and ("to=".startswith(start) or start.startswith("to="))

    def _after_body(self, marker: str | None) -> None:
        if marker == START:
            self._where, self._header = _Where.HEADER, _Header()
        else:
            self._where = _Where.BETWEEN

    def _begin_body(self, piece: ChatPiece) -> None:
        header = parse_header(self._header.text(self._decoder))
        recipient = header.recipient or ""
        name = recipient[len(FUNCTIONS) :] if recipient.startswith(FUNCTIONS) else None
        if name is not None and name in self._tool_names:
            piece.tool_calls.append(ToolCallDelta(index=self.calls, id=self._new_id(), name=name))
            self.calls += 1
            self._open_body("call")
        else:
            self._open_body("reasoning" if header.channel == "analysis" else "content")
        self._where = _Where.BODY

    def _open_body(self, sink: str) -> None:
        self._sink, self._body = sink, IncrementalDetokenizer(self._decoder)

    def _to_body(self, token: int, piece: ChatPiece) -> None:
        assert self._body is not None, "a body is open"
        self._put(self._body.add([token]), piece)

    def _close_body(self, piece: ChatPiece) -> None:
        if self._body is not None:
            self._put(self._body.flush(), piece)
            self._body = None

    def _put(self, text: str, piece: ChatPiece) -> None:
        if not text:
            return
        if self._sink == "call":
            piece.tool_calls.append(ToolCallDelta(index=self.calls - 1, arguments=text))
        elif self._sink == "reasoning":
            piece.reasoning += text
        else:
            piece.content += text
