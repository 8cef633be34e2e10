"""Split a chat reply's reasoning (``<think>...</think>``, Qwen3 and DeepSeek-R1 style) out of its
content, incrementally: text arrives in pieces of any size, and the pieces split the same way as the
whole text (each piece's split is final; text that may be the start of a tag waits for the next)."""

from __future__ import annotations

from enum import Enum

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag`` (0 if none):
    that much must wait for more text before it can be shown."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _Where(Enum):
    START = "start"  # nothing but whitespace yet: a <think> may still open the reply
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningSplitter:
    """``feed`` text, get (reasoning, content) pieces; ``finish`` releases what was held.

    ``inside`` is True when the prompt already opened the think block (a template that ends the
    generation prompt with ``<think>``): the reply then starts as reasoning. Only a think block at
    the start of the reply counts; whitespace right after either tag is dropped.
    """

    def __init__(self, inside: bool) -> None:
        self._where = _Where.REASONING if inside else _Where.START
        self._held = ""
        self._skip_space = inside

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning, content = "", ""
        while self._held:
            if self._skip_space:
                self._held = self._held.lstrip()
                if not self._held:
                    break
                self._skip_space = False
            if self._where is _Where.START:
                stripped = self._held.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._held = stripped[len(THINK_OPEN) :]
                    self._where, self._skip_space = _Where.REASONING, True
                elif THINK_OPEN.startswith(stripped):
                    break  # still maybe the tag
                else:
                    self._where = _Where.CONTENT
            elif self._where is _Where.REASONING:
                end = self._held.find(THINK_CLOSE)
                if end >= 0:
                    reasoning += self._held[:end]
                    self._held = self._held[end + len(THINK_CLOSE) :]
                    self._where, self._skip_space = _Where.CONTENT, True
                    continue
                keep = partial_tag_len(self._held, THINK_CLOSE)
                reasoning += self._held[: len(self._held) - keep]
                self._held = self._held[len(self._held) - keep :]
                break
            else:
                content += self._held
                self._held = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the reply: held text goes where it stands (a cut-off reply may end mid-thought)."""
        held, self._held = self._held, ""
        if self._where is _Where.REASONING:
            return held, ""
        return "", held
