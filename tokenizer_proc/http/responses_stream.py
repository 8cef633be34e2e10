"""A streamed Responses API response: server-sent events as OpenAI documents them.

``response.created`` and ``response.in_progress`` first; then per output item
``response.output_item.added``, its content (``content_part.added``, ``output_text.delta`` ...
``output_text.done``, ``content_part.done``; ``reasoning_text.*`` for reasoning;
``function_call_arguments.delta`` ... ``.done`` for a tool call) and ``response.output_item.done``;
last ``response.completed`` (``response.incomplete`` when max_output_tokens cut it,
``response.failed`` when the engine failed it). Every event has ``event:`` its type and a
``sequence_number`` counting from 0. No ``[DONE]``: OpenAI's Responses stream has none.

A failure mid-stream (an engine error reply, or a fault of ours while making the events) closes
the item being written as ``incomplete`` (every item added gets its ``output_item.done``), then
sends OpenAI's ``error`` event (``code``, ``message``, ``param``) and ``response.failed`` (its
``error`` the same), which ends the stream.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from protocol.messages import FinishReason, GenerateOutput
from tokenizer_proc.http.bridge import RequestHandle
from tokenizer_proc.http.choices import abort_on_disconnect
from tokenizer_proc.http.errors import engine_error
from tokenizer_proc.http.responses_output import Event
from tokenizer_proc.http.responses_run import ResponseRun

logger = logging.getLogger(__name__)
_ENCODER = msgspec.json.Encoder()
_FINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                 "cancelled": "response.failed"}  # fmt: skip


class ResponseEventStream(Response):
    """Relays one engine request's replies as Responses API events."""

    def __init__(self, handle: RequestHandle, run: ResponseRun) -> None:
        super().__init__(media_type="text/event-stream")
        self.handle = handle
        self.run = run
        self._sequence = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        watcher = asyncio.create_task(abort_on_disconnect([self.handle], receive))
        try:
            start = self.run.body("in_progress")
            await self._send(send, [{"type": "response.created", "response": start},
                                    {"type": "response.in_progress", "response": start}])  # fmt: skip
            failed = False
            while not (self.handle.finished or failed):
                events, failed = self._events_or_failure(await self.handle.next())
                await self._send(send, events)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            await self.handle.close()

    def _events_or_failure(self, reply: GenerateOutput) -> tuple[list[Event], bool]:
        """The events of ``reply``, and whether they ended the response as failed."""
        try:
            if reply.finish_reason is FinishReason.ERROR:
                error = engine_error(reply.error or "the engine failed the request")
                # OpenAI's error codes of a response: a prompt the engine cannot take, or its fault
                code = "server_error" if error.status >= 500 else "invalid_prompt"
                return self._failure(code, error.message), True
            return self._events(reply), False
        except Exception as exc:  # a bug of ours: the client still hears the response failed
            logger.exception("response %s failed while streaming", self.run.id)
            return self._failure("server_error", f"internal error: {exc!r}"), True

    def _failure(self, code: str, message: str) -> list[Event]:
        """Close the item being written, then OpenAI's ``error`` event and ``response.failed``."""
        events = self.run.output.finish("incomplete")
        error = {"code": code, "message": message}
        return [
            *events,
            {"type": "error", **error, "param": None},
            {"type": "response.failed", "response": self.run.body("failed", error=error)},
        ]

    def _events(self, reply: GenerateOutput) -> list[Event]:
        if reply.finish_reason is None:
            return self.run.output.feed(reply)
        body, events = self.run.finish(reply)
        return [*events, {"type": _FINAL_EVENTS[body["status"]], "response": body}]

    async def _send(self, send: Send, events: list[Event]) -> None:
        if not events:
            return
        chunks = []
        for event in events:
            numbered: dict[str, Any] = {**event, "sequence_number": self._sequence}
            self._sequence += 1
            chunks.append(
                b"event: " + event["type"].encode() + b"\ndata: " + _ENCODER.encode(numbered) + b"\n\n"
            )
        await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": True})
