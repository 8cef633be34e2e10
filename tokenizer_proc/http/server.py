"""uvicorn, run inside the tokenizer process's own event loop (no thread, no second loop)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn

from tokenizer_proc.http.app import HttpSettings, build_app
from tokenizer_proc.http.bridge import HttpBridge

logger = logging.getLogger(__name__)

# At shutdown, how long responses already being written may take to finish.
GRACEFUL_CLOSE_S = 2


# How often the server's loop ticks: it refreshes the Date header (whole seconds) and looks at
# should_exit. uvicorn ticks every 0.1 s, each tick a timer, a task step and a coroutine: CPU taken
# from the worker's threads at 32 streams (docs/benchmarks-history.md); ``request_exit`` wakes it.
TICK_S = 1.0


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers (SIGTERM belongs to the tokenizer process's drain logic),
    ticking once a second; ``request_exit`` stops it without waiting for a tick."""

    _exit: asyncio.Event | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def main_loop(self) -> None:
        """uvicorn's loop (on_tick: the Date header each second, should_exit), a tick a second."""
        self._exit = asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864000  # on_tick counts tenths of a second
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit.wait(), TICK_S)

    def request_exit(self) -> None:
        self.should_exit = True
        if self._exit is not None:
            self._exit.set()


class HttpServer:
    """Binds ``host:port`` at ``start`` (so a taken port fails before Ready) and serves until ``stop``."""

    def __init__(self, bridge: HttpBridge, settings: HttpSettings, host: str, port: int) -> None:
        self.host = host
        self.port = port
        config = uvicorn.Config(
            build_app(bridge, settings),
            http="httptools",
            lifespan="off",
            access_log=False,
            log_level="warning",
            timeout_graceful_shutdown=GRACEFUL_CLOSE_S,
        )
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self.port), family=family)
        self.port = sock.getsockname()[1]
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # startup failed: raise its error here
            await asyncio.sleep(0.01)
        logger.info("HTTP API on http://%s:%d/v1", self.host, self.port)

    async def stop(self) -> None:
        """Stop accepting, let responses in progress finish (up to GRACEFUL_CLOSE_S), then close."""
        if self._task is None:
            return
        self._server.request_exit()
        try:
            await asyncio.wait_for(self._task, GRACEFUL_CLOSE_S + 2)
        except TimeoutError:
            logger.warning("the HTTP server did not stop in time")
        self._task = None
