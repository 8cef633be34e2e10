"""The synchronous client: one DEALER socket, any number of interleaved requests."""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Generator
from types import TracebackType
from typing import Literal, Unpack, overload

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

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
from protocol.messages import (
    AbortRequest,
    ClientReply,
    FinishReason,
    FlushCacheRequest,
    GenerateOutput,
    GenerateRequest,
)
from protocol.transport import Codec

logger = logging.getLogger(__name__)


class Client:
    """Talks to a rivulet engine over ZMQ; not thread-safe (use one per thread).

    Replies are demultiplexed by rid: while one request waits, replies for the
    others are buffered, so several streams can be consumed interleaved.
    Waiting for a reply longer than ``timeout_s`` raises TimeoutError (and
    aborts the request in the engine); an error reply raises EngineError. Until
    an engine has answered at the endpoint, a request waits ``connect_timeout_s``
    at most, then raises EngineUnreachable ("nothing is listening at ...").
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
        self._ctx = zmq.Context()
        self._sock, self._monitor = connect_dealer(self._ctx, self.endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._codec: Codec[ClientReply] = Codec(ClientReply)
        self._pending: dict[str, deque[GenerateOutput]] = {}  # rid -> unread replies, while in flight
        self._choices = ChoiceCount()

    @overload
    def generate(
        self, prompt: str | None = None, *, stream: Literal[False] = False, **options: Unpack[GenerateOptions]
    ) -> GenerateOutput: ...

    @overload
    def generate(
        self, prompt: str | None = None, *, stream: Literal[True], **options: Unpack[GenerateOptions]
    ) -> Generator[GenerateOutput, None, None]: ...

    def generate(
        self, prompt: str | None = None, *, stream: bool = False, **options: Unpack[GenerateOptions]
    ) -> GenerateOutput | Generator[GenerateOutput, None, None]:
        """Send a request. stream=False: the final reply; stream=True: an iterator of deltas.

        The last delta carries ``finish_reason`` and ``usage``. The request is sent
        before this returns, so several streams can be started and read in any order.
        """
        req = make_request(prompt, stream, options)
        if not stream:
            single_choice(req)
        self._submit(req)
        if stream:
            return self._stream(req.rid)
        try:
            return self._next(req.rid)
        finally:
            self._forget(req.rid)

    def embed(self, prompt: str | list[int]) -> list[float]:
        """The embedding of one text or one list of token ids: the prompt's final hidden states
        pooled as the engine's model says (or its ``--pooling``) and L2-normalized; an error reply
        (a bad token id, a model whose pooling is not supported) raises EngineError."""
        text, input_ids = embed_input(prompt)
        return embedding_of(self.generate(text, input_ids=input_ids, embed=True))

    def flush_cache(self) -> None:
        """Drop the engine's cached prefixes (those no running request holds); returns once it is asked."""
        rid = f"flush-{uuid.uuid4().hex}"
        self._pending[rid] = deque()
        self._sock.send(self._codec.encode(FlushCacheRequest(rid=rid)))
        self._next(rid)

    def generate_choices(
        self, prompt: str | None = None, **options: Unpack[GenerateOptions]
    ) -> list[GenerateOutput]:
        """Send a request for ``n`` choices (from one prefill); their final replies, by index."""
        req = make_request(prompt, False, options)
        self._submit(req)
        finals: list[GenerateOutput] = []
        try:
            while len(finals) < req.n:
                reply = self._next(req.rid)
                if reply.finish_reason is not None:
                    finals.append(reply)
        finally:
            self._forget(req.rid)
        return sorted(finals, key=lambda reply: reply.index)

    def abort(self, rid: str) -> None:
        """Ask the engine to stop ``rid``; its stream then ends with finish_reason ABORT."""
        if rid in self._pending:
            self._sock.send(self._codec.encode(AbortRequest(rid=rid)))

    def close(self) -> None:
        self._pending.clear()
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _submit(self, req: GenerateRequest) -> None:
        if req.rid in self._pending:
            raise ValueError(f"rid {req.rid!r} is already in flight on this client")
        self._pending[req.rid] = deque()
        self._choices.start(req)
        self._sock.send(self._codec.encode(req))

    def _stream(self, rid: str) -> Generator[GenerateOutput, None, None]:
        try:
            while True:
                reply = self._next(rid)
                yield reply
                if reply.finish_reason is not None and rid not in self._pending:  # its last choice
                    return
        finally:
            self._forget(rid)

    def _next(self, rid: str) -> GenerateOutput:
        """The next reply for ``rid``, receiving (and buffering others') until it comes."""
        queue = self._pending[rid]
        started = time.monotonic()
        while not queue:
            limit_s = self.timeout_s if self._connected else min(self.timeout_s, self.connect_timeout_s)
            remaining_ms = (started + limit_s - time.monotonic()) * 1000
            ready = dict(self._poller.poll(max(1, int(remaining_ms)))) if remaining_ms > 0 else {}
            if not ready and not self._connected:
                raise nothing_listening(self.endpoint, limit_s)
            if not ready and time.monotonic() - started >= self.timeout_s:
                raise TimeoutError(f"no reply for request {rid!r} within {self.timeout_s} s")
            if self._sock in ready:
                self._connected = True
                self._dispatch(self._sock.recv())
            if self._monitor in ready:
                self._on_monitor_event()
        reply = queue.popleft()
        if reply.finish_reason is not None and self._choices.finished(reply):
            del self._pending[rid]  # finished: nothing to abort any more
        return check_reply(reply)

    def _dispatch(self, frame: bytes) -> None:
        try:
            reply = self._codec.decode(frame)
        except msgspec.DecodeError as exc:
            raise EngineError(f"malformed reply from the engine: {exc}") from exc
        if reply.rid in self._pending:
            self._pending[reply.rid].append(reply)
        elif not reply.rid and reply.error:
            # The engine could not read some request of ours: every waiter must hear it.
            for queue in self._pending.values():
                queue.append(reply)
        else:
            logger.debug("dropping a reply for %r, which is no longer in flight", reply.rid)

    def _on_monitor_event(self) -> None:
        """An engine answered; or the connection dropped (the engine died or stopped): then every
        waiting request fails, and the next one waits for an engine to answer again."""
        self._connected = recv_monitor_message(self._monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        if self._connected:
            return
        while self._sock.poll(0):  # the engine's last replies (e.g. "shutting down") come first
            self._dispatch(self._sock.recv())
        for rid, queue in self._pending.items():
            if not any(reply.finish_reason is not None for reply in queue):
                queue.append(GenerateOutput(rid=rid, finish_reason=FinishReason.ERROR, error=LOST_CONNECTION))

    def _forget(self, rid: str) -> None:
        """Stop tracking ``rid``; if it is still running (abandoned, timed out), abort it."""
        if rid in self._pending and not self._sock.closed:
            self._sock.send(self._codec.encode(AbortRequest(rid=rid)))
        self._pending.pop(rid, None)
        self._choices.forget(rid)
