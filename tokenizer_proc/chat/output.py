"""A chat reply's text -> content, reasoning and tool calls, the same whether it comes in pieces
(streaming) or whole: reasoning is split off first, then tool calls are parsed out of the rest."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from protocol.chat import ToolCallDelta
from tokenizer_proc.chat.reasoning import ReasoningSplitter
from tokenizer_proc.chat.template import ChatOutputPlan
from tokenizer_proc.chat.tool_parsers import ToolCallParser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ChatPiece:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ChatOutputParser:
    """Feeds a reply's text through the reasoning splitter and the tool-call parser its plan asks for.

    ``first_call_only`` (parallel_tool_calls false): the model may still write several calls, since
    the prompt cannot forbid it, so every call after the first is parsed (its text is no content)
    and dropped; the reply carries one call, as OpenAI's does.
    """

    def __init__(self, plan: ChatOutputPlan, new_id: Callable[[], str] = new_call_id) -> None:
        self._first_call_only = plan.first_call_only
        self._reasoning = ReasoningSplitter(plan.starts_in_reasoning) if plan.reasoning else None
        self._tools = None
        if plan.tool_format is not None:
            self._tools = ToolCallParser(plan.tool_format, set(plan.tool_names), new_id)

    @property
    def made_calls(self) -> bool:
        return self._tools is not None and self._tools.calls > 0

    def feed(self, text: str, *, final: bool, ids: Sequence[int] = ()) -> ChatPiece:
        """The next piece of the reply (``final``: the last; everything held comes out); ``ids``,
        its tokens, are the harmony parser's input, not this one's."""
        reasoning, content = "", text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text)
            if final:
                more_reasoning, more_content = self._reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self._tools is None:
            return ChatPiece(content, reasoning)
        content, calls = self._tools.feed(content)
        if final:
            more_content, more_calls = self._tools.finish()
            content, calls = content + more_content, calls + more_calls
        if self._first_call_only:
            calls = [call for call in calls if call.index == 0]
        return ChatPiece(content, reasoning, calls)


def merge_calls(pieces: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Streamed pieces -> one complete ToolCallDelta per call (what a whole reply carries)."""
    calls: dict[int, ToolCallDelta] = {}
    for piece in pieces:
        known = calls.get(piece.index)
        if known is None:
            calls[piece.index] = piece
        else:
            calls[piece.index] = ToolCallDelta(
                index=piece.index, id=known.id, name=known.name, arguments=known.arguments + piece.arguments
            )
    return [calls[i] for i in sorted(calls)]
