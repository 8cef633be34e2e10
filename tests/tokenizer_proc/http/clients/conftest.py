"""Shared pieces of the client-library tests: the switches that keep each library off the network,
a guard that fails a test whose client reached anything but the loopback engine, and a recorder of
the request bodies a client sent.

The tiny engine writes noise, so every outcome is pinned by the API: a forced tool call, an output
grammar whose values are enums, a small ``max_tokens``. The tests assert what the protocol decides
(the tool ran, the output parsed, the run ended), never the prose.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.tokenizer_proc.http.clients.common import Sent
from tests.tokenizer_proc.http.server import HttpEngine

# Read by the libraries when they are first imported (the test modules import them after this file):
# the Agents SDK's trace exporter, litellm's remote price table, LangSmith's tracer and the HF hub
# would each try the network.
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_TELEMETRY", "False")
os.environ.setdefault("LANGSMITH_TRACING", "false")
os.environ.setdefault("LANGCHAIN_TRACING_V2", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class OffLoopback:
    """Every connect or name lookup a client made to anything but this machine's loopback."""

    seen: list[str] = field(default_factory=list)

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if event == "socket.connect":
            address = args[1]
            host = address[0] if isinstance(address, tuple) else None
            if host is not None and not _loopback(host):
                self.seen.append(f"connect {address}")
        elif event == "socket.getaddrinfo" and not _loopback(str(args[0])):
            self.seen.append(f"lookup {args[0]}")


def _loopback(host: str) -> bool:
    if host in ("localhost", "None", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_OFF_LOOPBACK = OffLoopback()
sys.addaudithook(_OFF_LOOPBACK)  # audit hooks cannot be removed: it only records, the fixture judges


@pytest.fixture(autouse=True)
def no_network() -> Iterator[None]:
    """Cleared after the check, not before: what a library tried when the test modules imported it
    falls on the first test."""
    yield
    seen, _OFF_LOOPBACK.seen[:] = list(_OFF_LOOPBACK.seen), []
    assert not seen, f"a client library reached beyond the loopback: {seen}"


@pytest.fixture
def sent(api: HttpEngine) -> Sent:
    return Sent(api.v1)
