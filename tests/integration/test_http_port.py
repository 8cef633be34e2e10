"""--http-port 0: the HTTP API binds any free port, and the Ready line names the one it bound."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from tests.integration.engine import running_engine


def test_http_port_0_prints_the_bound_port(tmp_path: Path) -> None:
    with running_engine(None, tmp_path, "--http-port", "0") as engine:
        found = re.search(r" http=http://127\.0\.0\.1:(\d+) ", engine.ready_line)
        assert found is not None, f"no http= in the Ready line: {engine.ready_line!r}"
        port = int(found.group(1))
        assert port != 0, engine.ready_line
        reply = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10.0)
        assert reply.status_code == 200, reply.text
