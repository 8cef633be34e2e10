"""The model's text -> OpenAI tool calls, incrementally, for the call formats of the families we serve.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, anywhere in
  the reply (Hermes, Qwen2.5, Qwen3, and rivulet's own fallback prompt; see template.py).
- ``json``: the reply is one JSON call object ``{"name": ..., "parameters"|"arguments": {...}}``,
  optionally after ``<|python_tag|>``, several joined by ``;`` (Llama 3.x; also a call forced by a
  grammar, which writes the bare object).

A call's arguments are the model's own text of the arguments value (not re-serialized), streamed
as it is scanned, so the streamed pieces add up to exactly the whole reply's arguments. A call
becomes a call once its name is read and names an offered tool; until then its text is held, and
an object that turns out not to be a call is given back as content.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import Enum
from typing import Literal

from protocol.chat import ToolCallDelta
from tokenizer_proc.chat.reasoning import partial_tag_len

ToolFormat = Literal["hermes", "json", "harmony"]  # harmony: parsed by chat/harmony.py
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("arguments", "parameters")


def _json_string(literal: str) -> str | None:
    """The value of a JSON string literal as a model wrote it (raw control characters allowed);
    None when it is not one (a bad escape)."""
    try:
        value = json.loads(literal, strict=False)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class CallScanner:
    """Scans one JSON object char by char: its top-level ``name`` and the text of its arguments."""

    def __init__(self) -> None:
        self.raw = ""
        self.depth = 0
        self.done = False
        self.name: str | None = None
        self._in_string = self._escaped = False
        self._expect: Literal["key", "value"] = "key"
        self._key: str | None = None
        self._string_start = 0
        self._args_start: int | None = None
        self._args_end: int | None = None

    def feed(self, text: str) -> int:
        """Take chars of ``text`` up to the end of the object; return how many were taken."""
        for taken, c in enumerate(text, 1):
            self.raw += c
            self._step(c, len(self.raw) - 1)
            if self.done:
                return taken
        return len(text)

    def arguments(self) -> str:
        """The arguments text scanned so far; trailing whitespace waits (it may end the value)."""
        if self._args_start is None:
            return "{}" if self.done else ""
        end = self._args_end if self._args_end is not None else len(self.raw)
        return self.raw[self._args_start : end].rstrip()

    def _step(self, c: str, i: int) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
                if self.depth == 1:
                    self._top_string(_json_string(self.raw[self._string_start : i + 1]))
            return
        top = self.depth == 1
        if top and self._expect == "value" and self._args_start is None and not c.isspace():
            if self._key in ARGUMENT_KEYS:
                self._args_start = i
        if c == '"':
            self._in_string, self._string_start = True, i
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            self.done = self.depth == 0
            if self.done:
                self._end_value(i)
        elif top and c == ":":
            self._expect = "value"
        elif top and c == ",":
            self._end_value(i)
            self._expect = "key"

    def _top_string(self, value: object) -> None:
        if self._expect == "key":
            self._key = value if isinstance(value, str) else None
        elif self._key == "name" and isinstance(value, str) and self.name is None:
            self.name = value

    def _end_value(self, i: int) -> None:
        if self._key in ARGUMENT_KEYS and self._args_start is not None and self._args_end is None:
            self._args_end = i


class _State(Enum):
    TEXT = "text"  # content, watching for the start of a call
    START = "start"  # json: only whitespace so far; a call object (or <|python_tag|>) may begin
    CALL = "call"  # inside a call object
    AFTER = "after"  # a call object ended: hermes expects </tool_call>, json maybe ';' and another
    PLAIN = "plain"  # json: the reply is not a call; the rest is content


class ToolCallParser:
    """``feed`` text pieces, get (content, tool-call pieces); ``finish`` at the end of the reply."""

    def __init__(self, fmt: ToolFormat, tool_names: set[str], new_id: Callable[[], str]) -> None:
        self.fmt = fmt
        self.tool_names = tool_names
        self.calls = 0  # calls started so far
        self._new_id = new_id
        self._state = _State.TEXT if fmt == "hermes" else _State.START
        self._held = ""
        self._scanner: CallScanner | None = None
        self._sent_args = 0  # arguments chars of the open call already given out
        self._announced = False  # the open call's first piece went out
        self._skip_space = False  # a call just closed: whitespace after it is not content

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._held += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._held and self._step(content, deltas):
            pass
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The reply ended: a call whose name was never read is given back as content."""
        content, deltas = self.feed("")
        scanner, self._scanner = self._scanner, None
        if self._state is _State.CALL and scanner is not None and not self._is_call(scanner):
            content += self._unclaimed(scanner)
        content += self._held
        self._held = ""
        return content, deltas

    def _step(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """Handle the held text as far as it can be decided; False when more text is needed."""
        match self._state:
            case _State.TEXT:
                return self._in_text(content)
            case _State.START:
                return self._at_start()
            case _State.CALL:
                return self._in_call(content, deltas)
            case _State.AFTER:
                return self._after_call()
            case _State.PLAIN:
                content.append(self._held)
                self._held = ""
                return False
        raise AssertionError(f"unknown parser state {self._state}")

    def _in_text(self, content: list[str]) -> bool:
        if self._skip_space:
            self._held = self._held.lstrip()
            if not self._held:
                return False
            self._skip_space = False
        start = self._held.find(CALL_OPEN)
        if start < 0:
            keep = partial_tag_len(self._held, CALL_OPEN)
            content.append(self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
            return False
        content.append(self._held[:start])
        self._held = self._held[start + len(CALL_OPEN) :]  # whitespace before the object: the scanner's
        self._open_call()
        return True

    def _at_start(self) -> bool:
        stripped = self._held.lstrip()
        if stripped.startswith(PYTHON_TAG):
            self._held = stripped[len(PYTHON_TAG) :]
        elif stripped.startswith("{"):
            self._held = stripped
            self._open_call()
        elif not stripped or PYTHON_TAG.startswith(stripped):
            return False  # maybe still the tag
        else:
            self._state = _State.PLAIN
        return True

    def _open_call(self) -> None:
        self._state, self._scanner = _State.CALL, CallScanner()
        self._sent_args, self._announced = 0, False

    def _in_call(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        scanner = self._scanner
        assert scanner is not None, "a call state without its scanner"
        if not scanner.raw and not self._held.lstrip().startswith("{"):
            if not self._held.strip():
                return False
            content.append(self._unclaimed(scanner))  # <tool_call> not followed by an object
            self._state = self._text_state
            return True
        taken = scanner.feed(self._held)
        self._held = self._held[taken:]
        if scanner.name is not None and not self._is_call(scanner):  # names no offered tool
            content.append(self._unclaimed(scanner))
            self._state = self._text_state
            return True
        if self._is_call(scanner):
            self._emit(scanner, deltas)
        if not scanner.done:
            return False
        if self._is_call(scanner):
            self._state = _State.AFTER
        else:  # an object that is no call: all of it, and whatever follows, is content
            content.append(self._unclaimed(scanner))
            self._state = self._text_state
        return True

    @property
    def _text_state(self) -> _State:
        """Where text that is not a call goes on: hermes watches for the next call, json is done."""
        return _State.TEXT if self.fmt == "hermes" else _State.PLAIN

    def _is_call(self, scanner: CallScanner) -> bool:
        return scanner.name is not None and scanner.name in self.tool_names

    def _unclaimed(self, scanner: CallScanner) -> str:
        return (CALL_OPEN if self.fmt == "hermes" else "") + scanner.raw

    def _emit(self, scanner: CallScanner, deltas: list[ToolCallDelta]) -> None:
        """The call's first piece (id, name, the arguments so far) or its new arguments text."""
        args = scanner.arguments()
        if not self._announced:
            self._announced = True
            deltas.append(
                ToolCallDelta(index=self.calls, id=self._new_id(), name=scanner.name, arguments=args)
            )
            self.calls += 1
        elif len(args) > self._sent_args:
            deltas.append(ToolCallDelta(index=self.calls - 1, arguments=args[self._sent_args :]))
        self._sent_args = len(args)

    def _after_call(self) -> bool:
        stripped = self._held.lstrip()
        closer = CALL_CLOSE if self.fmt == "hermes" else ";"
        if stripped.startswith(closer):
            self._held = stripped[len(closer) :]
            self._skip_space = True
            self._state = _State.TEXT if self.fmt == "hermes" else _State.START
            return True
        if not stripped or closer.startswith(stripped):
            return False
        self._state = self._text_state
        return True
