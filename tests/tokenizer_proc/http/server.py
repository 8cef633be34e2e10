"""The real launcher with its HTTP API on a free loopback port, and /metrics and /proc readers."""

from __future__ import annotations

import contextlib
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.integration.engine import RunningEngine, running_engine

API_KEY = "test-key"
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$")


@dataclass
class HttpEngine:
    engine: RunningEngine
    base_url: str  # http://127.0.0.1:PORT

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"


def free_port() -> int:
    """A port that was free a moment ago (the OS picks it; the race with other users is tiny)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def http_engine(model: Path | None, tmp_path: Path, *args: str) -> Iterator[HttpEngine]:
    port = free_port()
    with running_engine(model, tmp_path, "--http-port", str(port), *args) as e:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, 30.0)
        yield HttpEngine(e, base_url)


def wait_healthy(base_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base_url + "/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{base_url}/health never said ok")


def metrics(base_url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed by name plus labels (``name{le="0.1"}``)."""
    text = httpx.get(base_url + "/metrics", timeout=5.0).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            out[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return out


def wait_idle_and_free(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and every KV page is free (or cached); return it."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(base_url)
        free = m["rivulet_kv_pages_free"] + m["rivulet_kv_pages_evictable"]
        idle = m["rivulet_num_requests_running"] == m["rivulet_num_requests_waiting"] == 0
        if idle and free == m["rivulet_kv_pages_total"] and m["rivulet_num_requests_in_flight"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle with all KV free after {timeout_s} s: {m}")
        time.sleep(0.05)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")
