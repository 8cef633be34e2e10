"""The asyncio client: one DEALER socket, one receiver task, a queue per in-flight rid."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from types import TracebackType
from typing import Literal, Unpack, cast, overload

import msgspec
import zmq
import zmq.asyncio
from zmq.asyncio import Socket as AsyncSocket
from zmq.utils.monitor import parse_monitor_message

from client.common import (
    CONNECT_TIMEOUT_S,
    LOST_CONNECTION,
    ChoiceCount,
    EngineError,
    GenerateOptions,
    check_reply,
    connect_dealer,
    default_endpoint,
    embed_input,
    embedding_of,
    make_request,
    nothing_listening,
    single_choice,
)
from protocol.messages import AbortRequest, ClientReply, GenerateOutput, GenerateRequest
from protocol.transport import Codec

logger = logging.getLogger(__name__)


class AsyncClient:
    """Talks to a rivulet engine from asyncio; any number of concurrent requests.

    A single receiver task reads every reply and routes it to its request's
    queue by rid. Waiting longer than ``timeout_s`` for a reply raises
    TimeoutError (and aborts the request); an error reply raises EngineError.
    Until an engine has answered at the endpoint, a request waits
    ``connect_timeout_s`` at most, then raises EngineUnreachable.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        timeout_s: float = 300.0,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        assert timeout_s > 0 and connect_timeout_s > 0, (
            f"timeouts must be positive: {timeout_s}, {connect_timeout_s}"
        )
        self.endpoint = endpoint or default_endpoint()
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._connected = False  # an engine answered (a handshake) and has not dropped since
        self._ctx = zmq.asyncio.Context()
        # connect_dealer is typed for sync sockets; an asyncio context makes asyncio sockets.
        sock, monitor = connect_dealer(self._ctx, self.endpoint)
        self._sock, self._monitor = cast(AsyncSocket, sock), cast(AsyncSocket, monitor)
        self._codec: Codec[ClientReply] = Codec(ClientReply)
        self._pending: dict[str, asyncio.Queue[GenerateOutput | EngineError]] = {}
        self._choices = ChoiceCount()
        self._receiver: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None

    @overload
    async def generate(
        self, prompt: str | None = None, *, stream: Literal[False] = False, **options: Unpack[GenerateOptions]
    ) -> GenerateOutput: ...

    @overload
    async def generate(
        self, prompt: str | None = None, *, stream: Literal[True], **options: Unpack[GenerateOptions]
    ) -> AsyncGenerator[GenerateOutput, None]: ...

    async def generate(
        self, prompt: str | None = None, *, stream: bool = False, **options: Unpack[GenerateOptions]
    ) -> GenerateOutput | AsyncGenerator[GenerateOutput, None]:
        """Send a request. stream=False: the final reply; stream=True: an async iterator of deltas."""
        req = make_request(prompt, stream, options)
        if not stream:
            single_choice(req)
        await self._submit(req)
        if stream:
            return self._stream(req.rid)
        try:
            return await self._next(req.rid)
        finally:
            await self._forget(req.rid)

    async def embed(self, prompt: str | list[int]) -> list[float]:
        """The embedding of one text or one list of token ids: the prompt's final hidden states
        pooled as the engine's model says (or its ``--pooling``) and L2-normalized; an error reply
        (a bad token id, a model whose pooling is not supported) raises EngineError."""
        text, input_ids = embed_input(prompt)
        return embedding_of(await self.generate(text, input_ids=input_ids, embed=True))

    async def generate_choices(
        self, prompt: str | None = None, **options: Unpack[GenerateOptions]
    ) -> list[GenerateOutput]:
        """Send a request for ``n`` choices (from one prefill); their final replies, by index."""
        req = make_request(prompt, False, options)
        await self._submit(req)
        finals: list[GenerateOutput] = []
        try:
            while len(finals) < req.n:
                reply = await self._next(req.rid)
                if reply.finish_reason is not None:
                    finals.append(reply)
        finally:
            await self._forget(req.rid)
        return sorted(finals, key=lambda reply: reply.index)

    async def abort(self, rid: str) -> None:
        """Ask the engine to stop ``rid``; its stream then ends with finish_reason ABORT."""
        if rid in self._pending:
            await self._sock.send(self._codec.encode(AbortRequest(rid=rid)))

    async def close(self) -> None:
        tasks = [t for t in (self._receiver, self._watcher) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._receiver = self._watcher = None
        self._pending.clear()
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _submit(self, req: GenerateRequest) -> None:
        if req.rid in self._pending:
            raise ValueError(f"rid {req.rid!r} is already in flight on this client")
        if self._receiver is None:
            self._receiver = asyncio.create_task(self._receive_loop())
            self._watcher = asyncio.create_task(self._watch_connection())
        self._pending[req.rid] = asyncio.Queue()
        self._choices.start(req)
        await self._sock.send(self._codec.encode(req))

    async def _stream(self, rid: str) -> AsyncGenerator[GenerateOutput, None]:
        try:
            while True:
                reply = await self._next(rid)
                yield reply
                if reply.finish_reason is not None and rid not in self._pending:  # its last choice
                    return
        finally:
            await self._forget(rid)

    async def _next(self, rid: str) -> GenerateOutput:
        item = await self._wait(rid)
        if isinstance(item, EngineError):  # the receiver itself failed
            self._pending.pop(rid, None)
            self._choices.forget(rid)
            raise item
        if item.finish_reason is not None and self._choices.finished(item):
            del self._pending[rid]  # finished: nothing to abort any more
        return check_reply(item)

    async def _wait(self, rid: str) -> GenerateOutput | EngineError:
        """The next item of ``rid``'s queue, within ``connect_timeout_s`` while no engine has answered,
        else within ``timeout_s``."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        while True:
            limit_s = self.timeout_s if self._connected else min(self.timeout_s, self.connect_timeout_s)
            try:
                return await asyncio.wait_for(self._pending[rid].get(), started + limit_s - loop.time())
            except TimeoutError:
                if not self._connected:
                    raise nothing_listening(self.endpoint, limit_s) from None
                if loop.time() - started >= self.timeout_s:
                    raise TimeoutError(f"no reply for request {rid!r} within {self.timeout_s} s") from None

    async def _receive_loop(self) -> None:
        while True:
            frame = await self._sock.recv()
            self._connected = True
            try:
                reply = self._codec.decode(frame)
            except msgspec.DecodeError as exc:
                self._fail_all(EngineError(f"malformed reply from the engine: {exc}"))
                continue
            queue = self._pending.get(reply.rid)
            if queue is not None:
                queue.put_nowait(reply)
            elif not reply.rid and reply.error:
                # The engine could not read some request of ours: every waiter must hear it.
                self._fail_all(EngineError(reply.error))
            else:
                logger.debug("dropping a reply for %r, which is no longer in flight", reply.rid)

    async def _watch_connection(self) -> None:
        """An engine answered; or the connection dropped (the engine died or stopped): then every
        waiting request fails, and the next one waits for an engine to answer again."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            self._connected = event == zmq.EVENT_HANDSHAKE_SUCCEEDED
            if self._connected:
                continue
            await asyncio.sleep(0.05)  # let the receiver route the engine's last replies first
            self._fail_all(EngineError(LOST_CONNECTION))

    def _fail_all(self, error: EngineError) -> None:
        for queue in self._pending.values():
            queue.put_nowait(error)

    async def _forget(self, rid: str) -> None:
        """Stop tracking ``rid``; if it is still running (abandoned, timed out), abort it."""
        if rid in self._pending and not self._sock.closed:
            await self._sock.send(self._codec.encode(AbortRequest(rid=rid)))
        self._pending.pop(rid, None)
        self._choices.forget(rid)
