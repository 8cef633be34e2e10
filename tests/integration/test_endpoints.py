"""Endpoints at start: a second launcher on a live engine's ipc endpoint, HTTP port or tcp endpoint
is refused at once naming it (the first keeps serving); a socket file a dead engine left is replaced;
a client at an endpoint nothing listens on is told so."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from client import Client, EngineUnreachable
from tests.integration.engine import REPO, running_engine


def _launch(*argv: str) -> tuple[int, list[str]]:
    """A launcher expected to refuse: its exit status and its stderr lines."""
    cmd = [sys.executable, "launcher.py", *argv]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout == "", "a refused launcher prints no Ready line"
    return done.returncode, done.stderr.splitlines()


def test_a_live_endpoint_is_refused_and_a_stale_one_replaced(tmp_path: Path) -> None:
    stale = tmp_path / "client.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:  # as a SIGKILLed engine leaves it
        gone.bind(str(stale))
    assert stale.is_socket()
    with running_engine(None, tmp_path, "--http-port", "0") as engine:
        assert engine.endpoint == f"ipc://{stale}"
        assert "removed the socket file of an engine that is gone" in engine.log()
        found = re.search(r" http=http://127\.0\.0\.1:(\d+) ", engine.ready_line)
        assert found is not None, engine.ready_line
        port = found.group(1)

        code, lines = _launch("--endpoint", engine.endpoint)
        assert (code, lines) == (2, [f"rivulet: --endpoint {engine.endpoint}: another engine is listening "
                                     "there (stop it or pick another)"])  # fmt: skip
        code, lines = _launch("--endpoint", f"ipc://{tmp_path}/other.sock", "--http-port", port)
        assert (code, lines) == (
            2,
            [f"rivulet: --http-port {port}: 127.0.0.1:{port} is in use (another engine?)"],
        )

        with Client(engine.endpoint, timeout_s=120) as client:  # the first engine still serves
            out = client.generate("Hello", max_new_tokens=2, ignore_eos=True)
        assert out.usage is not None and out.usage.completion_tokens == 2
    with (
        Client(engine.endpoint, connect_timeout_s=0.5) as client,
        pytest.raises(EngineUnreachable, match=f"nothing is listening at {engine.endpoint}"),
    ):
        client.generate("Hello")


def test_a_tcp_endpoint_in_use_is_refused(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        code, lines = _launch("--endpoint", endpoint)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"rivulet: --endpoint {endpoint}: ") and "is in use" in lines[0]
