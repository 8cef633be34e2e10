"""Engine replies -> the Responses API's output items, and the stream events that build them.

One ``OutputItems`` follows one response: each reply's reasoning goes to a ``reasoning`` item,
its text to a ``message`` item (one ``output_text`` part), each tool call to a ``function_call``
item, in the order they come; a new kind of piece closes the item being written. A whole reply
goes through the same steps (its events are then dropped), so a stream and a whole response
end in the same items. Events are returned without ``sequence_number`` (the stream numbers them).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from protocol.chat import ToolCallDelta
from protocol.messages import GenerateOutput
from tokenizer_proc.http.logprob_format import chat_logprobs
from tokenizer_proc.token_bytes import TokenTexts

Event = dict[str, Any]


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class OutputItems:
    """The output items of one response as they are written; ``logprobs``: the client asked for them."""

    texts: TokenTexts
    logprobs: bool
    items: list[dict[str, Any]] = field(default_factory=list)
    _open: dict[str, Any] | None = None  # the item being written
    _calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # tool call index -> its item
    _held_logprobs: list[dict[str, Any]] = field(default_factory=list)  # tokens not shown as text yet

    def feed(self, reply: GenerateOutput) -> list[Event]:
        """The events of one reply (a stream's delta, or the whole reply)."""
        events: list[Event] = []
        if self.logprobs and reply.logprobs is not None:
            found = chat_logprobs(self.texts, reply.token_ids, reply.logprobs, reply.top_logprobs)
            self._held_logprobs += found["content"]
        if reply.reasoning_text:
            events += self._reasoning(reply.reasoning_text)
        if reply.text:
            events += self._text(reply.text)
        for piece in reply.tool_calls or []:
            events += self._call(piece)
        return events

    def finish(self, status: str) -> list[Event]:
        """Close the open item (``status``: completed, or incomplete for a cut-off reply)."""
        if self._held_logprobs:  # the last tokens showed no text of their own (EOS)
            message = next((i for i in reversed(self.items) if i["type"] == "message"), None)
            if message is not None:
                message["content"][0]["logprobs"] += self._held_logprobs
            self._held_logprobs = []
        return self._close(status)

    def _reasoning(self, text: str) -> list[Event]:
        events = self._open_item("reasoning", lambda: {"summary": [], "content": []})
        item = self._current
        if not item["content"]:
            part = {"type": "reasoning_text", "text": ""}
            item["content"].append(part)
            events.append(self._part_event("response.content_part.added", dict(part)))
        item["content"][0]["text"] += text
        events.append(
            {"type": "response.reasoning_text.delta", **self._where(), "content_index": 0, "delta": text}
        )
        return events

    def _text(self, text: str) -> list[Event]:
        events = self._open_item("message", lambda: {"role": "assistant", "content": []})
        item = self._current
        if not item["content"]:
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append(self._part_event("response.content_part.added", {**part, "logprobs": []}))
        part = item["content"][0]
        part["text"] += text
        logprobs, self._held_logprobs = self._held_logprobs, []
        part["logprobs"] += logprobs
        delta = {"type": "response.output_text.delta", **self._where(), "content_index": 0, "delta": text}
        return [*events, {**delta, "logprobs": logprobs}]

    def _call(self, piece: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if piece.id is not None:  # a call's first piece names it
            events += self._close("completed")
            item = {"id": item_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": piece.id, "name": piece.name or "", "arguments": ""}  # fmt: skip
            self._calls[piece.index] = item
            events += self._add(item)
        item = self._calls[piece.index]
        assert item is self._open, "a tool call's pieces come together, before the next call"
        if piece.arguments:
            item["arguments"] += piece.arguments
            events.append({"type": "response.function_call_arguments.delta", **self._where(),
                           "delta": piece.arguments})  # fmt: skip
        return events

    @property
    def _current(self) -> dict[str, Any]:
        assert self._open is not None, "an item is open while its pieces come"
        return self._open

    def _open_item(self, kind: str, fields: Any) -> list[Event]:
        """Keep writing the open item if it is of ``kind``; else close it and add a new one."""
        if self._open is not None and self._open["type"] == kind:
            return []
        events = self._close("completed")
        prefix = {"reasoning": "rs", "message": "msg"}[kind]
        return events + self._add({"id": item_id(prefix), "type": kind, "status": "in_progress", **fields()})

    def _add(self, item: dict[str, Any]) -> list[Event]:
        self.items.append(item)
        self._open = item
        return [
            {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": _copy(item)}
        ]

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        events: list[Event] = []
        if item["type"] == "function_call":
            events.append({"type": "response.function_call_arguments.done", **where,
                           "name": item["name"], "arguments": item["arguments"]})  # fmt: skip
        elif item["content"]:
            part = item["content"][0]
            if item["type"] == "message":
                events.append({"type": "response.output_text.done", **where, "content_index": 0,
                               "text": part["text"], "logprobs": part["logprobs"]})  # fmt: skip
            else:
                events.append({"type": "response.reasoning_text.done", **where, "content_index": 0,
                               "text": part["text"]})  # fmt: skip
            events.append(
                {"type": "response.content_part.done", **where, "content_index": 0, "part": _copy(part)}
            )
        events.append(
            {"type": "response.output_item.done", "output_index": where["output_index"], "item": _copy(item)}
        )
        return events

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._current["id"], "output_index": len(self.items) - 1}

    def _part_event(self, kind: str, part: dict[str, Any]) -> Event:
        return {"type": kind, **self._where(), "content_index": 0, "part": part}


def _copy(value: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item as it is now (the item itself keeps growing)."""
    out = dict(value)
    if "content" in out:
        out["content"] = [_copy(part) for part in out["content"]]
    if "logprobs" in out:
        out["logprobs"] = list(out["logprobs"])
    return out
