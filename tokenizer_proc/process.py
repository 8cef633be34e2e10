"""The tokenizer process: the engine's front door, a thin asyncio loop around ``Frontend``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import cast

import msgspec
import uvloop
import zmq
import zmq.asyncio
from zmq.asyncio import Socket as AsyncSocket

from protocol.messages import Ready, ToTokenizer
from protocol.transport import Codec, Endpoints, make_socket
from tokenizer_proc.config import TokenizerConfig
from tokenizer_proc.frontend import Frontend
from tokenizer_proc.model_info import load_tokenizer, read_model_info
from tokenizer_proc.request_state import Outbox

logger = logging.getLogger(__name__)

# How long the final error replies may take to leave at shutdown.
SHUTDOWN_LINGER_MS = 500


def run_tokenizer(config: TokenizerConfig, endpoints: Endpoints) -> None:
    """Serve clients on ``endpoints.client`` until SIGTERM.

    Loads the tokenizer, binds the client ROUTER and the ``to_tokenizer`` PULL,
    sends ``Ready`` to the launcher, then relays: client requests become
    TokenizedRequest/AbortReq for the scheduler, TokenBatch rows become text
    replies. On SIGTERM every in-flight request gets an error reply first.
    """
    tokenizer = load_tokenizer(config.model_path)
    info = read_model_info(config.model_path, tokenizer)
    logger.info(
        "tokenizer ready: context %d, vocab %d, eos %s", info.context_len, info.vocab_size, info.eos_token_ids
    )
    frontend = Frontend(tokenizer, info, config.seed)
    uvloop.run(TokenizerServer(frontend, endpoints).serve())


class TokenizerServer:
    """Owns the sockets; every decision is made by the ``Frontend``."""

    def __init__(self, frontend: Frontend, endpoints: Endpoints) -> None:
        self._frontend = frontend
        self._endpoints = endpoints
        self._ctx = zmq.asyncio.Context()
        # make_socket is typed for sync sockets; an asyncio context makes asyncio sockets.
        self._client = cast(AsyncSocket, make_socket(self._ctx, zmq.ROUTER, endpoints.client, bind=True))
        self._from_scheduler = cast(
            AsyncSocket, make_socket(self._ctx, zmq.PULL, endpoints.to_tokenizer, bind=True)
        )
        self._to_scheduler = cast(
            AsyncSocket, make_socket(self._ctx, zmq.PUSH, endpoints.to_scheduler, bind=False)
        )
        self._to_launcher = cast(
            AsyncSocket, make_socket(self._ctx, zmq.PUSH, endpoints.to_launcher, bind=False)
        )
        self._scheduler_codec: Codec[ToTokenizer] = Codec(ToTokenizer)

    async def serve(self) -> None:
        """Run both receive loops until SIGTERM (or until one of them fails)."""
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        loops: list[asyncio.Task[object]] = [
            asyncio.create_task(self._client_loop()),
            asyncio.create_task(self._scheduler_loop()),
        ]
        stopper: asyncio.Task[object] = asyncio.create_task(stop.wait())
        await self._to_launcher.send(self._scheduler_codec.encode(Ready(proc="tokenizer", pid=os.getpid())))
        try:
            await asyncio.wait([stopper, *loops], return_when=asyncio.FIRST_COMPLETED)
            for task in loops:
                if task.done():
                    task.result()  # a crashed loop raises here, after the finally's replies
        finally:
            for task in [stopper, *loops]:
                task.cancel()
            await asyncio.gather(stopper, *loops, return_exceptions=True)
            await self._shutdown()

    async def _client_loop(self) -> None:
        while True:
            frames = await self._client.recv_multipart()
            await self._send(self._frontend.on_client_frames(frames))

    async def _scheduler_loop(self) -> None:
        while True:
            frame = await self._from_scheduler.recv()
            try:
                msg = self._scheduler_codec.decode(frame)
            except msgspec.DecodeError as exc:
                logger.error("dropping a malformed frame from the scheduler: %s", exc)
                continue
            await self._send(self._frontend.on_scheduler_msg(msg))

    async def _send(self, out: Outbox) -> None:
        for msg in out.to_scheduler:
            await self._to_scheduler.send(self._scheduler_codec.encode(msg))
        for client_id, reply in out.replies:
            await self._client.send_multipart([client_id, self._scheduler_codec.encode(reply)])

    async def _shutdown(self) -> None:
        out = self._frontend.shutdown()
        logger.info("shutting down; failing %d in-flight requests", len(out.replies))
        try:
            await self._send(out)
        finally:
            # The error replies must get out; everything else may be dropped.
            self._client.close(linger=SHUTDOWN_LINGER_MS)
            for sock in (self._from_scheduler, self._to_scheduler, self._to_launcher):
                sock.close(linger=0)
            self._ctx.term()
