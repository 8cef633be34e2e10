"""Engine replies -> OpenAI response bodies: whole completions and server-sent-event chunks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from protocol.messages import FinishReason, GenerateOutput, Usage
from tokenizer_proc.http.errors import engine_error

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


@dataclass
class ResponseShape:
    """How one request's replies become OpenAI JSON; holds what a stream must remember."""

    id: str
    model: str
    created: int
    chat: bool
    logprobs: bool
    include_usage: bool
    token_text: Callable[[list[int]], list[str]]  # one string per token id
    text_offset: int = 0  # characters sent so far (legacy logprobs' text_offset)
    sent_role: bool = False

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def whole(self, reply: GenerateOutput) -> dict[str, Any]:
        """The body of a non-streaming response from the one final reply."""
        assert reply.finish_reason is not None, "a whole response needs the final reply"
        choice: dict[str, Any] = {"index": 0, "logprobs": self._logprobs(reply)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": reply.text}
        else:
            choice["text"] = reply.text
        choice["finish_reason"] = reply.finish_reason.value
        return {**self._head(self.object), "choices": [choice], "usage": usage_body(reply.usage)}

    def events(self, reply: GenerateOutput) -> list[bytes]:
        """The SSE events for one streamed reply (none for a token that shows no text yet)."""
        if reply.finish_reason is FinishReason.ERROR:
            return [sse(engine_error(reply.error or "the engine failed the request").body())]
        final = reply.finish_reason is not None
        events = []
        if self.chat and not self.sent_role:
            self.sent_role = True
            events.append(self._chunk({"role": "assistant", "content": ""}, None, None))
        if reply.text or final or (self.logprobs and reply.token_ids):
            reason = reply.finish_reason.value if reply.finish_reason is not None else None
            delta: Any = {"content": reply.text} if reply.text or not final else {}
            events.append(self._chunk(delta if self.chat else reply.text, reason, self._logprobs(reply)))
        if final and self.include_usage:
            events.append(
                sse({**self._head(self._chunk_object), "choices": [], "usage": usage_body(reply.usage)})
            )
        return events

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chunk(self, content: Any, reason: str | None, logprobs: Any) -> bytes:
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": reason}
        choice["delta" if self.chat else "text"] = content
        body = {**self._head(self._chunk_object), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def _logprobs(self, reply: GenerateOutput) -> dict[str, Any] | None:
        if not self.logprobs or reply.logprobs is None:
            return None
        tokens = self.token_text(reply.token_ids)
        if self.chat:
            content = [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(tokens, reply.logprobs, strict=True)
            ]
            return {"content": content, "refusal": None}
        offsets = []
        for t in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": reply.logprobs,
            "top_logprobs": None,
            "text_offset": offsets,
        }
