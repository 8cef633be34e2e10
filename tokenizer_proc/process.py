"""The tokenizer process: the engine's front door, a thin asyncio loop around ``Frontend``.

It serves ZMQ clients on a ROUTER socket and, with ``http_port`` set, the
OpenAI HTTP API from the same event loop (``tokenizer_proc.http``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import replace
from typing import cast

import msgspec
import uvloop
import zmq
import zmq.asyncio
from zmq.asyncio import Socket as AsyncSocket

from protocol.messages import GenerateOutput, Ready, ToTokenizer
from protocol.profiling import cprofiled
from protocol.transport import HEARTBEAT_SOCKET_OPTIONS, Codec, Endpoints, freeze_startup_heap, make_socket
from tokenizer_proc.config import TokenizerConfig
from tokenizer_proc.frontend import Frontend
from tokenizer_proc.http.app import HttpSettings
from tokenizer_proc.http.bridge import HttpBridge, is_http_client
from tokenizer_proc.http.server import HttpServer
from tokenizer_proc.images import VisionProcessor
from tokenizer_proc.intake import Admitting
from tokenizer_proc.model_info import load_tokenizer, read_model_info
from tokenizer_proc.outbox import Outbox
from tokenizer_proc.router import Router

logger = logging.getLogger(__name__)

# How long the final error replies may take to leave at shutdown.
SHUTDOWN_LINGER_MS = 500
# A ZMQ client with requests in flight is probed this often; an undeliverable probe means it
# has gone (ROUTER_MANDATORY), and its requests are aborted. Streams learn it on the next token.
# A quarter second: a small model decodes fast enough that a probe once a second would let an
# abandoned request run to its end (docs/benchmarks-history.md); the probe costs one empty reply per busy
# client.
PROBE_INTERVAL_S = 0.25
PROBE = GenerateOutput(rid="")
# getsockopt's option and flag as plain ints: pyzmq's are enums, whose ``&`` runs in Python.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def run_tokenizer(config: TokenizerConfig, endpoints: Endpoints) -> None:
    """Serve clients on ``endpoints.client`` (and HTTP if configured) until SIGTERM.

    Loads the tokenizer, binds the client ROUTER, the ``to_tokenizer`` PULL and the
    HTTP port, sends ``Ready`` to the launcher, then relays: client requests become
    TokenizedRequest/FinishReq for the scheduler, TokenBatch rows become replies.
    SIGTERM drains (up to ``config.shutdown_timeout_s``), SIGUSR1 or a second SIGTERM
    stops at once; either way every request still in flight gets an error reply.
    """
    tokenizer = load_tokenizer(config.model_path)
    info = read_model_info(config.model_path, tokenizer, config.pooling)
    images = VisionProcessor.load(config.model_path, config.image_limits, tokenizer, config.mmproj)
    info = replace(info, images=images)
    logger.info(
        "tokenizer ready: context %d, vocab %d, eos %s", info.context_len, info.vocab_size, info.eos_token_ids
    )
    frontend = Frontend(tokenizer, info, config.seed, Router(config.dp_size, config.dp_routing))
    with cprofiled("tokenizer"):
        uvloop.run(TokenizerServer(frontend, endpoints, config).serve())


def client_socket(ctx: zmq.asyncio.Context, endpoint: str) -> AsyncSocket:
    """The client ROUTER: options must be set before bind to reach accepted connections."""
    sock = ctx.socket(zmq.ROUTER)
    # ROUTER_MANDATORY: a reply to a vanished client raises EHOSTUNREACH.
    for option, value in (*HEARTBEAT_SOCKET_OPTIONS, (zmq.ROUTER_MANDATORY, 1)):
        sock.setsockopt(option, value)
    sock.bind(endpoint)
    return sock


class TokenizerServer:
    """Owns the sockets and the HTTP server; every decision is made by the ``Frontend``."""

    def __init__(
        self, frontend: Frontend, endpoints: Endpoints, config: TokenizerConfig | None = None
    ) -> None:
        self._frontend = frontend
        self._config = config or TokenizerConfig()
        self._ctx = zmq.asyncio.Context()
        self._client = client_socket(self._ctx, endpoints.client)
        # The scheduler's rows: a plain socket on the same context, read when its FD wakes the loop
        # (_scheduler_loop), not through pyzmq's asyncio futures, whose per-message bookkeeping was a
        # large share of this process's Python at one stream (docs/benchmarks-history.md).
        self._from_scheduler = make_socket(
            zmq.Context.shadow(self._ctx.underlying), zmq.PULL, endpoints.to_tokenizer, bind=True
        )
        # make_socket is typed for sync sockets; an asyncio context makes asyncio sockets.
        # One per data-parallel replica (--dp-size); the Frontend says which a message goes to.
        self._to_schedulers = [
            cast(AsyncSocket, make_socket(self._ctx, zmq.PUSH, endpoints.replica(i).to_scheduler, bind=False))
            for i in range(frontend.router.dp_size)
        ]
        self._to_launcher = cast(
            AsyncSocket, make_socket(self._ctx, zmq.PUSH, endpoints.to_launcher, bind=False)
        )
        # Decodes the scheduler's frames (ToTokenizer); encodes every frame this process sends:
        # to the scheduler, to the launcher, and replies to ZMQ clients.
        self._codec: Codec[ToTokenizer] = Codec(ToTokenizer)
        self._bridge = HttpBridge(frontend, self._send)
        self._http: HttpServer | None = None
        if self._config.http_port is not None:
            settings = HttpSettings(self._config.served_model_name, self._config.api_key)
            self._http = HttpServer(self._bridge, settings, self._config.http_host, self._config.http_port)
        self._stop = asyncio.Event()  # SIGTERM: drain, then stop
        self._stop_now = asyncio.Event()  # SIGUSR1 or a second SIGTERM: stop without draining
        self._compiles: set[asyncio.Task[None]] = set()  # ZMQ requests waiting for their grammar
        # Set by every ZMQ client message: the probe loop sleeps on it while no ZMQ client has a
        # request in flight (HTTP-only serving), instead of waking four times a second for nothing.
        self._zmq_client_sent = asyncio.Event()

    async def serve(self) -> None:
        """Run the receive loops until a signal (or until one of them fails), then shut down."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
        loop.add_signal_handler(signal.SIGUSR1, self._on_sigusr1)
        loops: list[asyncio.Task[object]] = [
            asyncio.create_task(self._client_loop()),
            asyncio.create_task(self._scheduler_loop()),
            asyncio.create_task(self._probe_loop()),
        ]
        stopper: asyncio.Task[object] = asyncio.create_task(self._stop.wait())
        try:
            if self._http is not None:
                await self._http.start()
            http_port = None if self._http is None else self._http.port
            ready = Ready(proc="tokenizer", pid=os.getpid(), http_port=http_port)
            freeze_startup_heap()
            await self._to_launcher.send(self._codec.encode(ready))
            await asyncio.wait([stopper, *loops], return_when=asyncio.FIRST_COMPLETED)
            for task in loops:
                if task.done():
                    task.result()  # a crashed loop raises here, after the finally's replies
            await self._drain(loops)
        finally:
            for task in [stopper, *loops]:
                task.cancel()
            await asyncio.gather(stopper, *loops, return_exceptions=True)
            await self._shutdown()

    def _on_sigterm(self) -> None:
        if self._stop.is_set():
            self._stop_now.set()
        self._stop.set()

    def _on_sigusr1(self) -> None:
        self._stop_now.set()
        self._stop.set()

    async def _drain(self, loops: list[asyncio.Task[object]]) -> None:
        """Refuse new requests; give running ones up to shutdown_timeout_s to finish."""
        self._frontend.draining = True
        timeout_s = self._config.shutdown_timeout_s
        if timeout_s <= 0 or self._stop_now.is_set() or not len(self._frontend.requests):
            return
        logger.info("draining %d requests for up to %.1f s", len(self._frontend.requests), timeout_s)

        async def drained() -> None:
            while len(self._frontend.requests):
                await asyncio.sleep(0.05)

        waiters = [asyncio.create_task(drained()), asyncio.create_task(self._stop_now.wait())]
        await asyncio.wait([*waiters, *loops], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for task in waiters:
            task.cancel()

    async def _client_loop(self) -> None:
        """One client message at a time. The Frontend answers every fault of its own (it never
        raises); a fault in sending what it made is logged, and the loop goes on."""
        while True:
            frames = await self._client.recv_multipart()
            self._zmq_client_sent.set()  # a request may start: the probes resume
            try:
                await self._send(self._frontend.on_client_frames(frames))
            except Exception:
                logger.exception("sending the answer to a client message failed")

    async def _scheduler_loop(self) -> None:
        """The scheduler's frames in order, each handled (and its sends done) before the next.

        The socket's FD only says its state may have changed: ``EVENTS`` tells whether a frame
        waits (and clears the FD). The loop sleeps on a future the FD's reader completes, after
        looking at ``EVENTS`` itself, so a frame that came in meanwhile is never missed."""
        loop = asyncio.get_running_loop()
        sock = self._from_scheduler
        fd = cast(int, sock.getsockopt(zmq.FD))
        waiter: asyncio.Future[None] | None = None

        def readable() -> None:
            if waiter is not None and not waiter.done():
                waiter.set_result(None)  # the loop's own EVENTS, before the next poll, clears the FD
            else:
                sock.getsockopt(_EVENTS)  # clears the FD, so the reader is not called again for it

        loop.add_reader(fd, readable)
        try:
            while True:
                if not cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
                    waiter = loop.create_future()
                    await waiter
                    continue
                await self._on_scheduler_frame(sock.recv(zmq.NOBLOCK))  # a frame waits: no EAGAIN
        finally:
            loop.remove_reader(fd)

    async def _on_scheduler_frame(self, frame: bytes) -> None:
        try:
            msg = self._codec.decode(frame)
        except msgspec.DecodeError as exc:
            logger.error("dropping a malformed frame from the scheduler: %s", exc)
            return
        try:  # a fault on one request's row fails that request (RequestTable); this is the rest
            await self._send(self._frontend.on_scheduler_msg(msg))
        except Exception:
            logger.exception("handling a %s from the scheduler failed", type(msg).__name__)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            zmq_clients = [c for c in self._frontend.requests.client_ids() if not is_http_client(c)]
            if not zmq_clients:  # none to probe: no timer wakes the process until a ZMQ client sends
                self._zmq_client_sent.clear()
                await self._zmq_client_sent.wait()
                continue
            await self._send(Outbox(replies=[(client_id, PROBE) for client_id in zmq_clients]))

    async def _send(self, out: Outbox) -> None:
        for pending in out.to_compile:
            task = asyncio.create_task(self._admit_after_compile(pending))
            self._compiles.add(task)
            task.add_done_callback(self._compiles.discard)
        for msg in out.to_scheduler:
            frame = self._codec.encode(msg)
            for replica in self._frontend.destinations(msg):
                await self._to_schedulers[replica].send(frame)
        gone: set[bytes] = set()
        for client_id, reply in out.replies:
            if is_http_client(client_id):
                self._bridge.deliver(client_id, reply)
            elif client_id not in gone and not await self._reply(client_id, reply):
                gone.add(client_id)
        for client_id in gone:
            aborted = self._frontend.client_gone(client_id)
            if aborted.to_scheduler:
                logger.info(
                    "client %r went away; aborting its %d requests", client_id, len(aborted.to_scheduler)
                )
            await self._send(Outbox(to_scheduler=aborted.to_scheduler))  # its replies could not be delivered

    async def _admit_after_compile(self, pending: Admitting) -> None:
        """Compile a ZMQ request's grammar on the compiler's threads while this loop serves on."""
        out = await self._frontend.admit_after_compile(pending)  # never raises but on cancel
        self._zmq_client_sent.set()  # it is in flight now: probe it
        try:
            await self._send(out)
        except Exception:
            logger.exception("request %r: sending its admission failed", pending.req.rid)

    async def _reply(self, client_id: bytes, reply: GenerateOutput) -> bool:
        """Send one reply; False when the client is gone (EHOSTUNREACH under ROUTER_MANDATORY)."""
        try:
            await self._client.send_multipart([client_id, self._codec.encode(reply)])
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            return False
        return True

    async def _shutdown(self) -> None:
        out = self._frontend.shutdown()  # requests still compiling get their error reply too
        for task in self._compiles:
            task.cancel()
        self._frontend.grammars.close()
        logger.info("shutting down; failing %d in-flight requests", len(out.replies))
        try:
            await self._send(out)
            if self._http is not None:
                await self._http.stop()  # lets the HTTP handlers write the errors just delivered
        finally:
            # The error replies must get out; everything else may be dropped.
            self._client.close(linger=SHUTDOWN_LINGER_MS)
            for sock in (self._from_scheduler, *self._to_schedulers, self._to_launcher):
                sock.close(linger=0)
            self._ctx.term()
