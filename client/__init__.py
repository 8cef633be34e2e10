"""Clients of a rivulet engine: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

``DEFAULT_ENDPOINT`` is where the launcher binds the client socket by default;
``RIVULET_ENDPOINT`` in the environment overrides it for clients.
"""

from client.async_client import AsyncClient
from client.client import Client
from client.common import DEFAULT_ENDPOINT, ENDPOINT_ENV, EngineError, EngineUnreachable, default_endpoint
from protocol.grammar import Grammar

__all__ = [
    "DEFAULT_ENDPOINT",
    "ENDPOINT_ENV",
    "AsyncClient",
    "Client",
    "EngineError",
    "EngineUnreachable",
    "Grammar",
    "default_endpoint",
]
