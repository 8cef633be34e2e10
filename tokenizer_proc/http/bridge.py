"""Connects HTTP handlers to the Frontend: each HTTP request is a client of its own.

An HTTP request gets a private client id (``HTTP_CLIENT_PREFIX`` + a counter),
so the Frontend's request table, validation, detokenizer and stop strings serve
HTTP exactly as they serve ZMQ clients. The process loop hands replies for
those ids to ``deliver``, which puts them on the choice's queue, or hands them to
the listener a streamed response set (``RequestHandle.listen``). ZMQ routing
ids never collide: libzmq's are 5 bytes and user-chosen ones may not start with
a zero byte.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from protocol.messages import GenerateOutput, GenerateRequest
from tokenizer_proc.frontend import Frontend
from tokenizer_proc.outbox import Outbox
from tokenizer_proc.validation_error import RequestRejected

logger = logging.getLogger(__name__)

HTTP_CLIENT_PREFIX = b"\x00http:"


def is_http_client(client_id: bytes) -> bool:
    return client_id.startswith(HTTP_CLIENT_PREFIX)


class HttpBridge:
    """Submits HTTP requests to the Frontend and routes their replies to per-request queues."""

    def __init__(self, frontend: Frontend, send: Callable[[Outbox], Awaitable[None]]) -> None:
        self.frontend = frontend
        self._send = send
        self._choices: dict[bytes, list[_Choice]] = {}  # one per choice
        self._next_id = 0

    @property
    def ready(self) -> bool:
        """The scheduler has reported in, and shutdown has not begun."""
        return self.frontend.engine_stats is not None and not self.frontend.draining

    async def submit(self, req: GenerateRequest, *, clamp_to_context: bool = True) -> list[RequestHandle]:
        """Admit ``req`` (raises RequestRejected) and return the handles its choices' replies
        arrive on, one per choice (``req.n``). ``clamp_to_context`` False: the client set its
        output limit, and one beyond the context is refused (validate_generate)."""
        client_id = HTTP_CLIENT_PREFIX + str(self._next_id).encode()
        self._next_id += 1
        try:
            out = await self.frontend.admit(client_id, req, clamp_to_context=clamp_to_context)
        except RequestRejected:
            raise
        except Exception as exc:  # a bug: end whatever it left in the table; the app answers 500
            await self._send(self.frontend.client_fault(client_id, req.rid, f"internal error: {exc!r}"))
            raise
        self._choices[client_id] = [_Choice() for _ in range(req.n)]
        await self._send(out)
        return [RequestHandle(self, client_id, index) for index in range(req.n)]

    async def next_reply(self, client_id: bytes, index: int) -> GenerateOutput:
        return await self._choices[client_id][index].queue.get()

    def listen(self, client_id: bytes, index: int, listener: Listener) -> None:
        """Hand choice ``index``'s replies to ``listener`` from now on (those queued first)."""
        choice = self._choices[client_id][index]
        while not choice.queue.empty():
            listener(choice.queue.get_nowait())
        choice.listener = listener

    def deliver(self, client_id: bytes, reply: GenerateOutput) -> None:
        choices = self._choices.get(client_id)
        if choices is not None and 0 <= reply.index < len(choices):
            choice = choices[reply.index]
            if choice.listener is None:
                choice.queue.put_nowait(reply)
            else:
                choice.listener(reply)
        # else: the handler is gone already (the reply is the ABORT of its own disconnect)

    async def abort(self, client_id: bytes) -> None:
        """Abort the request, every choice (their handles then read a final ABORT reply)."""
        out = self.frontend.client_gone(client_id)
        if out.to_scheduler:
            logger.info("HTTP client %r went away; aborted its request", client_id[len(HTTP_CLIENT_PREFIX) :])
        await self._send(out)

    async def close(self, client_id: bytes) -> None:
        """The handler is done: abort the request if it still runs, and stop routing to it."""
        await self.abort(client_id)
        self._choices.pop(client_id, None)


# Takes a choice's replies as they are delivered, in the process loop's own call: it must not
# raise (a fault would be the loop's, and the other requests' replies of that step would be lost)
# nor block.
Listener = Callable[[GenerateOutput], None]


class _Choice:
    """Where one choice's replies go: its queue (``RequestHandle.next``) until a listener is set."""

    __slots__ = ("listener", "queue")

    def __init__(self) -> None:
        self.queue: asyncio.Queue[GenerateOutput] = asyncio.Queue()
        self.listener: Listener | None = None


class RequestHandle:
    """One HTTP request's view of one choice of its engine request."""

    def __init__(self, bridge: HttpBridge, client_id: bytes, index: int = 0) -> None:
        self._bridge = bridge
        self.client_id = client_id
        self.index = index
        self.finished = False

    async def next(self) -> GenerateOutput:
        reply = await self._bridge.next_reply(self.client_id, self.index)
        self.finished = reply.finish_reason is not None
        return reply

    def listen(self, listener: Listener) -> None:
        """Have each reply handed to ``listener`` as the process delivers it (the ones waiting
        first), instead of queued for ``next``: a stream writes without waking its handler's
        coroutine chain for each token (choices.EventStream). ``finished`` is then the listener's
        to set."""
        self._bridge.listen(self.client_id, self.index, listener)

    async def final(self) -> GenerateOutput:
        while not self.finished:
            reply = await self.next()
        return reply

    async def abort(self) -> None:
        """Abort the request now, every choice (their queues then get a final ABORT reply)."""
        await self._bridge.abort(self.client_id)

    async def close(self) -> None:
        await self._bridge.close(self.client_id)
