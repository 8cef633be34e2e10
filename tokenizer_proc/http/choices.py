"""The engine requests behind one HTTP response: one per choice, read whole or as one merged stream.

A completions request with a batch of prompts becomes one engine request per prompt, submitted
together (so they are batched by the scheduler like any concurrent requests) and answered as
one response; with n > 1 each engine request has n choices (forked from one prefill). Choice
``index`` is ``prompt's place in the batch * n + choice``, as OpenAI numbers them. A client that
goes away aborts all of them at once.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

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


# The scope key under which ``with_server_send`` leaves the server's own ``send``.
SERVER_SEND = "rivulet.server_send"


def with_server_send(app: ASGIApp) -> ASGIApp:
    """``app`` behind one more ASGI layer that leaves the server's ``send`` in the scope: a stream
    writes its body through it, past Starlette's error and exception middleware. Their three
    wrappers of ``send`` look only at a response's start (to know whether an exception may still
    become a 500), so a body written past them is the same; no middleware of ours changes a body."""

    async def app_with_server_send(scope: Scope, receive: Receive, send: Send) -> None:
        scope[SERVER_SEND] = send
        await app(scope, receive, send)

    return app_with_server_send


class EventStream(Response):
    """An SSE response merging the choices' streams as their replies arrive.

    It ends with the usage chunk (``include_usage``) and ``[DONE]`` once every choice finished,
    or with an error event as soon as one fails (the others are then aborted).

    The replies are taken as the process delivers them (``RequestHandle.listen``): their events are
    made there, in arrival order, and a writer task of the stream's own sends what has gathered,
    one write for all a step brought (several choices, a verify row's tokens). Waiting on a queue
    instead would resume the handler through uvicorn's and Starlette's ~15 coroutine frames for
    every token (docs/benchmarks-history.md, "The engine's own CPU at 32 streams").
    """

    def __init__(self, handles: list[RequestHandle], shape: ResponseShape) -> None:
        super().__init__(media_type="text/event-stream")
        self.handles = handles
        self.shape = shape
        self._usages: list[Usage | None] = [None] * len(handles)  # each choice's, as it finishes
        self._remaining = len(handles)  # choices not finished
        self._pending: list[bytes] = []  # events made, not written yet
        self._over = False  # the last event is made: [DONE], an error event, or a fault
        self._fault: Exception | None = None  # making the events raised: the writer raises it
        self._wake: asyncio.Future[None] | None = None  # the writer waits on it for events
        self._send: Send | None = None  # the server's send, once the response started
        self._unfinished: Awaitable[None] | None = None  # a write begun in _take, for the writer to end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        tasks = [asyncio.create_task(abort_on_disconnect(self.handles, receive))]
        try:
            self._send = scope.get(SERVER_SEND, send)
            for index, handle in enumerate(self.handles):
                handle.listen(functools.partial(self._take, index))
            writer = asyncio.create_task(self._write(self._send))
            tasks.append(writer)
            await writer
        finally:
            for task in tasks:
                task.cancel()
            await close_all(self.handles)

    def _take(self, index: int, reply: GenerateOutput) -> None:
        """Choice ``index``'s reply, in the process loop: its events join the pending ones, and the
        writer is woken. Never raises (bridge.Listener): a fault is the writer's to raise."""
        if self._over:
            return  # after an error, the other choices' replies until they are aborted
        try:
            self._pending += self.shape.events(index, reply)
            if reply.finish_reason is FinishReason.ERROR:
                self._over = True  # its error event ends the stream, no [DONE]
            elif reply.finish_reason is not None:
                self.handles[index].finished = True
                self._usages[index] = reply.usage
                self._remaining -= 1
                if not self._remaining:
                    usage = self.shape.usage_event(self._usages)
                    self._pending += ([usage] if usage is not None else []) + [DONE_EVENT]
                    self._over = True
        except Exception as exc:  # a bug of ours: the handler raises it, as it would have
            self._fault, self._over = exc, True
        if self._wake is None or self._wake.done():
            return  # the writer is busy, or not started: it sends these next
        if self._over:
            self._wake.set_result(None)
        elif self._pending:
            self._write_now(self._wake)

    def _write_now(self, wake: asyncio.Future[None]) -> None:
        """Send the pending events in this call while the writer waits (nothing of this stream is
        being written), when the server's send completes without waiting, as it does unless flow
        control paused the connection: the writer is then not woken for them (a task step a token,
        docs/benchmarks-history.md). A send that waits is the writer's to finish, in order before
        anything else; a send that raises is the handler's to raise (``_fault``)."""
        assert self._send is not None, "the writer waits only once the response started"
        body = b"".join(self._pending)
        self._pending.clear()
        write = self._send({"type": "http.response.body", "body": body, "more_body": True})
        if not isinstance(write, Coroutine):
            self._unfinished = write  # an awaitable of another kind: the writer awaits it
        else:
            try:
                waiting_on = write.send(None)
            except StopIteration:
                return  # written
            except Exception as exc:
                self._fault, self._over = exc, True
            else:
                self._unfinished = _Resumed(write, waiting_on)
        wake.set_result(None)

    async def _write(self, send: Send) -> None:
        """Send the events as they gather, the last with the end of the body."""
        loop = asyncio.get_running_loop()
        while True:
            if not (self._pending or self._over or self._unfinished):
                self._wake = loop.create_future()
                await self._wake
            if self._unfinished is not None:
                unfinished, self._unfinished = self._unfinished, None
                await unfinished
            body = b"".join(self._pending)
            self._pending.clear()
            ends = self._over and self._fault is None
            if body or ends:
                await send({"type": "http.response.body", "body": body, "more_body": not ends})
            if self._fault is not None:
                raise self._fault
            if ends:
                return


class _Resumed:
    """Awaiting it runs on a coroutine that was begun by hand (``coro.send(None)``) and yielded
    ``waiting_on`` (the future it waits for) to the task that awaits this, as ``await coro`` would
    have from the start: what the task sends or throws in goes on to the coroutine."""

    def __init__(self, coro: Coroutine[Any, Any, None], waiting_on: Any) -> None:
        self._coro = coro
        self._waiting_on = waiting_on

    def __await__(self) -> Generator[Any, Any, None]:
        value = self._waiting_on
        while True:
            try:
                sent = yield value
            except BaseException as exc:  # a cancel (or other exception) thrown in by the task
                try:
                    value = self._coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    value = self._coro.send(sent)
                except StopIteration:
                    return
