"""One Responses API response from request to stored record: its body at each status, its
usage, and the conversation a ``previous_response_id`` continues from."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.chat import ChatMessage
from protocol.messages import FinishReason, GenerateOutput, Usage
from tokenizer_proc.http.responses_input import input_messages
from tokenizer_proc.http.responses_output import Event, OutputItems
from tokenizer_proc.http.responses_schema import ResponsesRequest
from tokenizer_proc.http.responses_store import ResponseStore

# finish_reason -> the response's status (ERROR is "failed", answered apart)
STATUS = {FinishReason.STOP: "completed", FinishReason.TOOL_CALLS: "completed",
          FinishReason.LENGTH: "incomplete", FinishReason.ABORT: "cancelled"}  # fmt: skip


def echo_fields(body: ResponsesRequest, model: str) -> dict[str, Any]:
    """The request's settings as a response object repeats them (OpenAI's defaults filled in)."""
    text_format: dict[str, Any] = {"type": "text"}
    if body.text is not None and body.text.format is not None:
        fmt = body.text.format
        text_format = {k: v for k, v in _fields(fmt).items() if v is not None}
    effort = body.reasoning.effort if body.reasoning is not None else None
    verbosity = (body.text.verbosity if body.text is not None else None) or "medium"
    return {
        "object": "response", "model": model, "background": False,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": None, "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": effort, "summary": None}, "service_tier": "default",
        "store": body.store is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": text_format, "verbosity": verbosity},
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": body.tools or [], "top_logprobs": body.top_logprobs or 0,
        "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": body.truncation or "disabled",
        "user": body.user, "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key, "prompt_cache_retention": body.prompt_cache_retention,
    }  # fmt: skip


def _fields(struct: Any) -> dict[str, Any]:
    return {name: getattr(struct, name) for name in struct.__struct_fields__}


def usage_body(usage: Usage | None, reasoning_tokens: int) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


@dataclass
class ResponseRun:
    """A response being made: ``conversation`` is its prompt's messages without the instructions
    (what a continuation inherits), ``count_tokens`` counts the reasoning text's tokens for usage."""

    id: str
    echo: dict[str, Any]
    conversation: list[ChatMessage]
    output: OutputItems
    store: ResponseStore | None  # None: not stored (store=false)
    count_tokens: Callable[[str], int]
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(
        self, status: str, usage: Usage | None = None, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The response object at ``status``."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        reasoning = "".join(
            part["text"]
            for item in self.output.items
            if item["type"] == "reasoning"
            for part in item["content"]
        )
        return {
            "id": self.id, "created_at": self.created_at, "status": status, "error": error,
            "incomplete_details": incomplete, **self.echo, "output": list(self.output.items),
            "usage": usage_body(usage, self.count_tokens(reasoning) if reasoning else 0),
        }  # fmt: skip

    def finish(self, reply: GenerateOutput) -> tuple[dict[str, Any], list[Event]]:
        """The final body after ``reply`` (the last of a stream, or the whole reply; not an error)
        and the events that close the output; the response is stored when it asked to be."""
        assert reply.finish_reason is not None and reply.finish_reason is not FinishReason.ERROR, (
            "finish takes a final reply that is no error"
        )
        status = STATUS[reply.finish_reason]
        events = self.output.feed(reply)
        events += self.output.finish("incomplete" if status == "incomplete" else "completed")
        body = self.body(status, reply.usage)
        if self.store is not None and status != "cancelled":
            self.store.put(self.id, body, self.conversation + self._output_messages())
        return body, events

    def _output_messages(self) -> list[ChatMessage]:
        """The output as the assistant's turn of a continuation (reasoning not shown, as chat's)."""
        said = [item for item in self.output.items if item["type"] != "reasoning"]
        return input_messages(said) if said else [ChatMessage(role="assistant", content="")]
