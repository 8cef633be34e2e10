"""The engine requests behind one HTTP response: one per choice, read whole or as one merged stream.

A completions request with a batch of prompts becomes one engine request per prompt, submitted
together (so they are batched by the scheduler like any concurrent requests) and answered as
one response; with n > 1 each engine request has n choices (forked from one prefill). Choice
``index`` is ``prompt's place in the batch * n + choice``, as OpenAI numbers them. A client that
goes away aborts all of them at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from protocol.messages import FinishReason, GenerateOutput, GenerateRequest, Usage
from tokenizer_proc.http.bridge import HttpBridge, RequestHandle
from tokenizer_proc.http.completion_bodies import DONE_EVENT, ResponseShape


async def submit_all(
    bridge: HttpBridge, reqs: list[GenerateRequest], *, clamp_to_context: bool = True
) -> list[RequestHandle]:
    """Submit every request, or none: when one is rejected the ones already in are aborted and
    the rejection (RequestRejected) propagates. One handle per choice, in choice index order."""
    handles: list[RequestHandle] = []
    try:
        for req in reqs:
            handles += await bridge.submit(req, clamp_to_context=clamp_to_context)
    except BaseException:
        await close_all(handles)
        raise
    return handles


async def close_all(handles: list[RequestHandle]) -> None:
    for handle in handles:
        await handle.close()


async def abort_on_disconnect(handles: list[RequestHandle], receive: Callable[[], Awaitable[Any]]) -> None:
    """Read the ASGI receive channel until the client disconnects, then abort every unfinished
    request at once (the scheduler hears of it before its next step and frees their KV)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    for handle in handles:
        if not handle.finished:
            await handle.abort()


async def whole_replies(handles: list[RequestHandle], receive: Receive) -> list[GenerateOutput]:
    """Each request's final reply, in choice order; the handles are closed afterwards."""
    watcher = asyncio.create_task(abort_on_disconnect(handles, receive))
    try:
        return list(await asyncio.gather(*(handle.final() for handle in handles)))
    finally:
        watcher.cancel()
        await close_all(handles)


class EventStream(Response):
    """An SSE response merging the choices' streams as their replies arrive.

    It ends with the usage chunk (``include_usage``) and ``[DONE]`` once every choice finished,
    or with an error event as soon as one fails (the others are then aborted).
    """

    def __init__(self, handles: list[RequestHandle], shape: ResponseShape) -> None:
        super().__init__(media_type="text/event-stream")
        self.handles = handles
        self.shape = shape
        self._usages: list[Usage | None] = [None] * len(handles)  # each choice's, as it finishes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        tasks = [asyncio.create_task(abort_on_disconnect(self.handles, receive))]
        if len(self.handles) == 1:  # one choice is read from its own queue: a task switch less a token
            only = self.handles[0]

            async def next_reply() -> tuple[int, GenerateOutput]:
                return 0, await only.next()
        else:
            merged: asyncio.Queue[tuple[int, GenerateOutput]] = asyncio.Queue()
            tasks += [asyncio.create_task(_forward(i, h, merged)) for i, h in enumerate(self.handles)]
            next_reply = merged.get
        try:
            if await self._send_choices(next_reply, send):
                usage = self.shape.usage_event(self._usages)
                for event in ([usage] if usage is not None else []) + [DONE_EVENT]:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            for task in tasks:
                task.cancel()
            await close_all(self.handles)

    async def _send_choices(
        self, next_reply: Callable[[], Awaitable[tuple[int, GenerateOutput]]], send: Send
    ) -> bool:
        """Relay replies (each with its choice's index) until every choice is done (True) or one
        failed (False: its error event ends the stream, no [DONE])."""
        remaining = len(self.handles)
        while remaining:
            index, reply = await next_reply()
            for event in self.shape.events(index, reply):
                await send({"type": "http.response.body", "body": event, "more_body": True})
            if reply.finish_reason is FinishReason.ERROR:
                return False
            if reply.finish_reason is not None:
                self._usages[index] = reply.usage
                remaining -= 1
        return True


async def _forward(
    index: int, handle: RequestHandle, merged: asyncio.Queue[tuple[int, GenerateOutput]]
) -> None:
    while not handle.finished:
        merged.put_nowait((index, await handle.next()))
