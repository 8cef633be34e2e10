"""Start an engine for a benchmark and always tear it down, every process it started included.

``rivulet_server`` runs ``launcher.py`` on its own ipc endpoint in a temp dir;
``openai_server`` runs any OpenAI-compatible server command (llama.cpp's server, say) and
waits for ``GET /health`` and ``GET /v1/models``. Both yield a ``Server`` and stop it by pid on
exit: SIGTERM, then SIGKILL for the launcher and for every descendant seen while it ran.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 300.0
STOP_GRACE_S = 10.0
ARGPARSE_EXIT = 2  # argparse's exit status for a bad command line


class FlagNotAvailable(RuntimeError):
    """The launcher does not accept one of the configuration's flags (not implemented yet)."""


@dataclass
class Server:
    """A running engine: the process we started, its descendants, and where clients reach it."""

    name: str
    proc: subprocess.Popen[bytes]
    address: str  # zmq endpoint or HTTP base URL
    log_path: Path
    pids: dict[int, int] = field(default_factory=dict)  # every process seen in its tree -> start time

    def log_tail(self, n_chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-n_chars:]

    def watch(self) -> None:
        """Remember the tree's processes now, so stop() can reach them even once orphaned."""
        self.pids |= descendants(self.proc.pid)

    def alive_pids(self) -> list[int]:
        return [pid for pid, start in self.pids.items() if pid_alive(pid, start)]


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks) of ``pid`` from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_alive(pid: int, start_ticks: int | None = None) -> bool:
    """True while ``pid`` runs (not a zombie) and, if given, is the process that started at ``start_ticks``.

    The start time guards against pid reuse: a pid we saw once may belong to someone else later.
    """
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z" and (start_ticks is None or stat[2] == start_ticks)


def descendants(root: int) -> dict[int, int]:
    """Every live process below ``root``, as pid -> start time (Linux /proc; empty elsewhere)."""
    stats = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            stats[int(entry)] = stat
    found: dict[int, int] = {}
    frontier = {root}
    while frontier:
        frontier = {pid for pid, st in stats.items() if st[1] in frontier and pid not in found}
        found |= {pid: stats[pid][2] for pid in frontier}
    return found


def rejected_flags(flags: list[str]) -> str | None:
    """Why launcher.py would reject ``flags`` (unknown flag, invalid choice), or None if it accepts them."""
    import launcher

    parser = launcher.build_parser()
    parser.exit_on_error = False
    try:
        _, unknown = parser.parse_known_args(flags)
    except argparse.ArgumentError as exc:
        return str(exc)
    return f"unrecognized arguments: {' '.join(unknown)}" if unknown else None


def _wait_ready_line(server: Server, stdout_path: Path, deadline: float) -> None:
    """Block until the launcher prints "rivulet ready:"; raise if it exits or the deadline passes."""
    while time.monotonic() < deadline:
        server.watch()
        if b"rivulet ready:" in stdout_path.read_bytes():
            return
        if server.proc.poll() is not None:
            if server.proc.returncode == ARGPARSE_EXIT:
                raise FlagNotAvailable(server.log_tail(500).strip().splitlines()[-1])
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode}:\n{server.log_tail()}")
        time.sleep(0.1)
    raise TimeoutError(f"{server.name} was not ready in time:\n{server.log_tail()}")


def _wait_http_ready(server: Server, deadline: float) -> None:
    while time.monotonic() < deadline:
        server.watch()
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            # /health says when requests are served (llama-server's while it loads the model,
            # rivulet's until its scheduler is up: /v1/models answers earlier in both).
            ready = all(httpx.get(f"{server.address}{path}", timeout=2.0).status_code == 200
                        for path in ("/health", "/v1/models"))  # fmt: skip
            if ready:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{server.name} was not ready in time:\n{server.log_tail()}")


def stop(server: Server) -> None:
    """SIGTERM the process we started, SIGKILL it after a grace period, then any descendant left."""
    proc = server.proc
    if proc.poll() is None:
        server.watch()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)
    deadline = time.monotonic() + 5.0
    while server.alive_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in server.alive_pids():
        with contextlib.suppress(ProcessLookupError):  # it exited just now
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _started(server: Server) -> Iterator[Server]:
    stat = _stat(server.proc.pid)
    server.pids[server.proc.pid] = stat[2] if stat else 0
    try:
        yield server
    finally:
        stop(server)


@contextlib.contextmanager
def rivulet_server(
    name: str,
    flags: list[str],
    workdir: Path,
    model: str | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
    env: dict[str, str] | None = None,
    repo: Path = REPO,
) -> Iterator[Server]:
    """``launcher.py [--model M] --endpoint ipc://WORKDIR/client.sock FLAGS``, stopped on exit.

    ``env``: more environment for the engine; ``repo``: the checkout whose launcher runs (another
    worktree, for an old-against-new run). Raises FlagNotAvailable before starting anything when
    the launcher would reject FLAGS.
    """
    if (why := rejected_flags(flags)) is not None:
        raise FlagNotAvailable(why)
    workdir.mkdir(parents=True, exist_ok=True)
    endpoint = f"ipc://{workdir}/client.sock"
    model_args = ["--model", model] if model else []
    cmd = [sys.executable, "launcher.py", *model_args, "--endpoint", endpoint, *flags]
    log_path, stdout_path = workdir / "engine.log", workdir / "engine.stdout"
    with open(log_path, "wb") as log, open(stdout_path, "wb") as out:
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(cmd, cwd=repo, stdout=out, stderr=log, env=full_env)
    with _started(Server(name, proc, endpoint, log_path)) as server:
        _wait_ready_line(server, stdout_path, time.monotonic() + ready_timeout_s)
        yield server


@contextlib.contextmanager
def openai_server(
    name: str, cmd: list[str], base_url: str, workdir: Path, ready_timeout_s: float = READY_TIMEOUT_S
) -> Iterator[Server]:
    """Any OpenAI-compatible server started by ``cmd``; ready once ``GET /health`` and ``GET /v1/models``
    answer 200."""
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    with _started(Server(name, proc, base_url.rstrip("/"), log_path)) as server:
        _wait_http_ready(server, time.monotonic() + ready_timeout_s)
        yield server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
