"""Engine replies -> the bodies of completions and chat completions: whole replies and
server-sent-event chunks (the Responses API builds its own in ``responses_*.py``).

One response may hold several choices (a completions request with a batch of prompts, n > 1):
choice ``index`` is ``prompt * n + choice``; usage is summed over them, each prompt counted once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import msgspec

from protocol.chat import ToolCallDelta
from protocol.logprobs import TopLogprobs
from protocol.messages import FinishReason, GenerateOutput, Usage
from tokenizer_proc.http.chat_fields import legacy_call
from tokenizer_proc.http.errors import engine_error
from tokenizer_proc.http.logprob_format import chat_logprobs, completion_logprobs
from tokenizer_proc.token_bytes import TokenTexts

DONE_EVENT = b"data: [DONE]\n\n"
_ENCODER = msgspec.json.Encoder()


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _ENCODER.encode(payload) + b"\n\n"


def usage_body(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def total_usage(usages: list[Usage | None], choices_per_prompt: int = 1) -> Usage | None:
    """The choices' usage summed; the ``choices_per_prompt`` choices of one prompt (n > 1) share
    it, so its tokens count once."""
    if any(u is None for u in usages):
        return None
    known = [u for u in usages if u is not None]
    firsts = known[::choices_per_prompt]
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in firsts),
        completion_tokens=sum(u.completion_tokens for u in known),
        cached_tokens=sum(u.cached_tokens for u in firsts),
    )


def best_choices(replies: list[GenerateOutput], drawn: int, keep: int) -> list[GenerateOutput]:
    """best_of: of each prompt's ``drawn`` choices, the ``keep`` with the highest logprob per token
    (OpenAI's rule), best first; ties go to the lower index."""
    kept: list[GenerateOutput] = []
    for first in range(0, len(replies), drawn):
        group = replies[first : first + drawn]
        kept += sorted(group, key=lambda r: -_mean_logprob(r))[:keep]
    return kept


def _mean_logprob(reply: GenerateOutput) -> float:
    logprobs = reply.logprobs or []
    return sum(logprobs) / len(logprobs) if logprobs else float("-inf")


def chat_message(reply: GenerateOutput) -> dict[str, Any]:
    """A whole chat reply's message: content null when the reply only calls tools."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if reply.reasoning_text:
        message["reasoning_content"] = reply.reasoning_text
    if reply.tool_calls:
        message["content"] = reply.text or None
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in reply.tool_calls
        ]
    return message


def chat_delta(text: str, reply: GenerateOutput, final: bool) -> dict[str, Any]:
    """A streamed chat chunk's delta; an empty content only on a bare non-final chunk (logprobs)."""
    delta: dict[str, Any] = {}
    if text or not (final or reply.reasoning_text or reply.tool_calls):
        delta["content"] = text
    if reply.reasoning_text:
        delta["reasoning_content"] = reply.reasoning_text
    if reply.tool_calls:
        delta["tool_calls"] = [_call_delta(c) for c in reply.tool_calls]
    return delta


def _call_delta(piece: ToolCallDelta) -> dict[str, Any]:
    """OpenAI's tool-call delta: a call's first piece names it, later ones add argument text."""
    if piece.id is None:
        return {"index": piece.index, "function": {"arguments": piece.arguments}}
    return {"index": piece.index, "id": piece.id, "type": "function",
            "function": {"name": piece.name, "arguments": piece.arguments}}  # fmt: skip


@dataclass
class ResponseShape:
    """How one HTTP request's replies become OpenAI JSON; holds what a stream must remember."""

    id: str
    model: str
    created: int
    chat: bool
    logprobs: bool
    include_usage: bool
    texts: TokenTexts
    choices_per_prompt: int = 1  # n: the choices of one prompt, which share its usage
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the chat object repeats
    legacy_functions: bool = False  # the request said ``functions``: calls are ``function_call``
    text_offsets: dict[int, int] = field(default_factory=dict)  # per choice: characters sent so far
    sent_role: set[int] = field(default_factory=set)  # chat choices whose role chunk went out

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def whole(self, replies: list[GenerateOutput], usage: Usage | None = None) -> dict[str, Any]:
        """The body of a non-streaming response from each choice's one final reply; ``usage``:
        the replies' unless given (best_of: of every choice drawn, kept or not)."""
        choices = []
        for index, reply in enumerate(replies):
            assert reply.finish_reason is not None, "a whole response needs the final reply"
            choice: dict[str, Any] = {"index": index, "logprobs": self._logprobs(index, reply)}
            if self.chat:
                choice["message"] = self._legacy(chat_message(reply))
            else:
                choice["text"] = (reply.prompt_text or "") + reply.text
            choice["finish_reason"] = self._finish_reason(reply.finish_reason)
            choices.append(choice)
        if usage is None:
            usage = total_usage([r.usage for r in replies], self.choices_per_prompt)
        return {**self._head(self.object), "choices": choices, "usage": usage_body(usage)}

    def events(self, index: int, reply: GenerateOutput) -> list[bytes]:
        """The SSE events for one streamed reply of choice ``index`` (none for a token that shows
        no text yet). The usage chunk is ``usage_event``'s, once every choice is done."""
        if reply.finish_reason is FinishReason.ERROR:
            return [sse(engine_error(reply.error or "the engine failed the request").body())]
        final = reply.finish_reason is not None
        events = []
        if self.chat and index not in self.sent_role:
            self.sent_role.add(index)
            events.append(self._chunk(index, {"role": "assistant", "content": ""}, None, None))
        text = (reply.prompt_text or "") + reply.text
        shows = text or reply.reasoning_text or reply.tool_calls
        if shows or final or (self.logprobs and (reply.token_ids or reply.prompt_token_ids)):
            reason = self._finish_reason(reply.finish_reason) if reply.finish_reason is not None else None
            content = self._legacy(chat_delta(text, reply, final)) if self.chat else text
            events.append(self._chunk(index, content, reason, self._logprobs(index, reply)))
        return events

    def usage_event(self, usages: list[Usage | None]) -> bytes | None:
        """The last chunk of a stream with ``include_usage``: no choices, the summed usage."""
        if not self.include_usage:
            return None
        return sse(
            {
                **self._head(self._chunk_object),
                "choices": [],
                "usage": usage_body(total_usage(usages, self.choices_per_prompt)),
            }
        )

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, **self.echo}

    def _finish_reason(self, reason: FinishReason) -> str:
        if self.legacy_functions and reason is FinishReason.TOOL_CALLS:
            return "function_call"
        return reason.value

    def _legacy(self, message: dict[str, Any]) -> dict[str, Any]:
        """A message or delta with its tool call as the legacy ``function_call`` (there is at
        most one: legacy requests allow one call)."""
        calls = message.pop("tool_calls", None) if self.legacy_functions else None
        if calls:
            message["function_call"] = legacy_call(calls[0])
        return message

    def _chunk(self, index: int, content: Any, reason: str | None, logprobs: Any) -> bytes:
        """One chunk's event: ``data: {head..., "choices": [choice], ("usage": null)}``, the parts
        that are the same in every chunk of the stream encoded once (``_chunk_frame``)."""
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": reason}
        choice["delta" if self.chat else "text"] = content
        before, after = self._chunk_frame
        return before + _ENCODER.encode(choice) + after

    @functools.cached_property
    def _chunk_frame(self) -> tuple[bytes, bytes]:
        """The event of a chunk (``sse`` of its body) is these two around its one choice's JSON."""
        head = _ENCODER.encode(self._head(self._chunk_object))
        assert head.endswith(b"}") and len(head) > 2, "the head is a JSON object with fields"
        usage = b',"usage":null' if self.include_usage else b""
        return b"data: " + head[:-1] + b',"choices":[', b"]" + usage + b"}\n\n"

    def _logprobs(self, index: int, reply: GenerateOutput) -> dict[str, Any] | None:
        if not self.logprobs or reply.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(self.texts, reply.token_ids, reply.logprobs, reply.top_logprobs)
        ids: list[int] = list(reply.token_ids)
        logprobs: list[float | None] = list(reply.logprobs)
        tops: list[TopLogprobs | None] | None = None
        if reply.top_logprobs is not None:
            tops = list(reply.top_logprobs)
        if reply.prompt_token_ids is not None and reply.prompt_logprobs is not None:  # echo: prompt first
            ids = reply.prompt_token_ids + ids
            logprobs = reply.prompt_logprobs + logprobs
            if tops is not None:
                tops = (reply.prompt_top_logprobs or [None] * len(reply.prompt_token_ids)) + tops
        body, self.text_offsets[index] = completion_logprobs(
            self.texts, ids, logprobs, tops, self.text_offsets.get(index, 0)
        )
        return body
