"""What the client-library tests share: the shapes every library is asked for and a recorder of the
request bodies a client sent (read off the ``openai`` package's HTTP client, not a stand-in)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx2
from pydantic import BaseModel

from tests.tokenizer_proc.http.server import API_KEY

MODEL = "tiny"
ASK = "What is the weather in Paris?"
CITIES = ("paris", "rome")


class Verdict(BaseModel):
    """An output whose grammar leaves the model two short strings, so it always ends in budget."""

    answer: Literal["yes", "no"]


LOOKUP_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": list(CITIES)}},
    "required": ["city"],
    "additionalProperties": False,
}


@dataclass
class Sent:
    """The JSON bodies a client sent, in order, read off its HTTP client (the ``openai`` package's)."""

    v1: str
    bodies: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def _record(self, request: httpx2.Request) -> None:
        body = request.read()
        self.bodies.append((request.url.path, json.loads(body) if body else {}))

    async def _arecord(self, request: httpx2.Request) -> None:
        self._record(request)

    def http_client(self) -> httpx2.Client:
        return httpx2.Client(event_hooks={"request": [self._record]})

    def async_http_client(self) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(event_hooks={"request": [self._arecord]})

    def to(self, path: str) -> list[dict[str, Any]]:
        """The bodies sent to ``/v1/<path>``."""
        return [body for sent_path, body in self.bodies if sent_path == f"/v1/{path}"]


__all__ = ["API_KEY", "ASK", "CITIES", "LOOKUP_PARAMETERS", "MODEL", "Sent", "Verdict"]
