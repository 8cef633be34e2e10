"""The launcher's children: how each starts, and the ``Engine`` that starts, watches and stops them.

Children die with the launcher (PR_SET_PDEATHSIG), so no process is ever orphaned.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq

from protocol import ToLauncher, WorkerReady
from protocol.transport import Codec, Endpoints, make_socket, replica_name

logger = logging.getLogger("rivulet.launcher")

STOP_GRACE_S = 4.0  # SIGTERM -> SIGKILL; the whole shutdown stays under 5 s
LOG_FORMAT = "[%(asctime)s %(processName)s] %(message)s"


class ChildDied(RuntimeError):
    """A child process exited while the engine was starting or serving."""

    def __init__(self, name: str, exitcode: int | None) -> None:
        super().__init__(f"{name} exited with code {exitcode}")
        self.name = name
        self.exitcode = exitcode


def _child_main(entry: str, config: Any, endpoints: Endpoints, log_level: str) -> None:
    """Runs first in every child: die with the launcher, leave Ctrl-C to it, log alike.

    ``entry`` is "module:function", imported here so the launcher never loads torch.
    """
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT, stream=sys.stderr, force=True)
    module_name, func_name = entry.split(":")
    run: Callable[[Any, Endpoints], None] = getattr(importlib.import_module(module_name), func_name)
    run(config, endpoints)


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os._exit(1)


ENTRIES = {
    "gpu_worker": "gpu_worker.process:run_worker",
    "tokenizer": "tokenizer_proc.process:run_tokenizer",
    "scheduler": "scheduler_proc.process:run_scheduler",
}


class Engine:
    """The launcher's view of the running processes."""

    def __init__(self, endpoints: Endpoints, log_level: str) -> None:
        self.endpoints = endpoints
        self.log_level = log_level
        self.children: dict[str, BaseProcess] = {}
        self._mp = multiprocessing.get_context("spawn")
        self._zmq = zmq.Context()
        self._ready_sock = make_socket(self._zmq, zmq.PULL, endpoints.to_launcher, bind=True)
        self._codec: Codec[ToLauncher] = Codec(ToLauncher)

    def start(self, name: str, config: Any, endpoints: Endpoints | None = None) -> None:
        """Start child ``name`` (``scheduler.1``: replica 1's scheduler, on ``endpoints``)."""
        proc = self._mp.Process(
            target=_child_main,
            args=(ENTRIES[name.split(".")[0]], config, endpoints or self.endpoints, self.log_level),
            name=name,
        )
        proc.start()
        self.children[name] = proc

    def wait_ready(self, names: set[str], timeout_s: float) -> dict[str, ToLauncher]:
        """Block until every child in ``names`` said Ready; raise ChildDied if one exits first."""
        got: dict[str, ToLauncher] = {}
        deadline = time.monotonic() + timeout_s
        while names - got.keys():
            self.raise_if_dead()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no Ready from {sorted(names - got.keys())} in {timeout_s:.0f} s")
            if not self._ready_sock.poll(200):
                continue
            try:
                msg = self._codec.decode(self._ready_sock.recv())
            except msgspec.DecodeError as exc:
                logger.warning("dropped a malformed frame on the launcher socket: %s", exc)
                continue
            if isinstance(msg, WorkerReady):
                got[replica_name("gpu_worker", msg.replica, msg.tp_rank)] = msg
            else:
                got[msg.proc] = msg
        return got

    def raise_if_dead(self) -> None:
        for name, proc in self.children.items():
            if proc.exitcode is not None:
                raise ChildDied(name, proc.exitcode)

    def supervise(self, wakeup: socket.socket) -> None:
        """Block until a child exits (raise ChildDied) or a signal byte arrives on ``wakeup``."""
        sentinels = {proc.sentinel: name for name, proc in self.children.items()}
        while True:
            ready = multiprocessing.connection.wait([*sentinels, wakeup])
            if wakeup in ready:
                return
            self.raise_if_dead()

    def stop(self, drain_s: float = 0.0) -> None:
        """Stop the tokenizer first (it tells waiting clients), then the rest; SIGKILL stragglers.

        ``drain_s`` > 0 (a graceful stop): the tokenizer gets SIGTERM and up to ``drain_s``
        to let running requests finish while the others keep serving them; if another
        child dies meanwhile, or on a stop after a failure, it gets SIGUSR1: fail all now.
        """
        self._stop_tokenizer(drain_s)
        ranks = {"tokenizer": 0, "scheduler": 1, "gpu_worker": 2}
        order = sorted(self.children, key=lambda name: (ranks[name.split(".")[0]], name))
        for name in order:
            proc = self.children[name]
            if proc.exitcode is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for name in order:
            proc = self.children[name]
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                logger.warning("%s did not stop on SIGTERM; killing pid %s", name, proc.pid)
                proc.kill()
                proc.join(1.0)
        self._ready_sock.close()
        self._zmq.term()

    def _stop_tokenizer(self, drain_s: float) -> None:
        tokenizer = self.children.get("tokenizer")
        if tokenizer is None or tokenizer.exitcode is not None or tokenizer.pid is None:
            return
        os.kill(tokenizer.pid, signal.SIGTERM if drain_s > 0 else signal.SIGUSR1)
        if drain_s <= 0:
            return
        others = [p.sentinel for n, p in self.children.items() if n != "tokenizer" and p.exitcode is None]
        ready = multiprocessing.connection.wait([tokenizer.sentinel, *others], drain_s + STOP_GRACE_S)
        if tokenizer.sentinel not in ready and tokenizer.exitcode is None:
            os.kill(tokenizer.pid, signal.SIGUSR1)  # a sibling died or the drain overran: stop now
