"""Stored responses (``store``, on by default): what ``previous_response_id``, ``GET`` and
``DELETE /v1/responses/{id}`` find.

In memory only, so a restart forgets them: an LRU of at most ``max_entries`` responses, each
forgotten ``ttl_s`` after it was stored (a lookup makes it the most recently used, not younger).
An entry holds the response's body as it was answered and its conversation as chat messages (every
earlier turn, its input and its output; not its instructions, which a continuation does not
inherit).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from protocol.chat import ChatMessage

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as answered
    conversation: list[ChatMessage]  # the messages a continuation starts from
    stored_s: float


class ResponseStore:
    """A bounded map of response id -> StoredResponse (LRU order, time to live)."""

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert max_entries >= 1 and ttl_s > 0, (
            f"a store of {max_entries} entries kept {ttl_s} s holds nothing"
        )
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, body: dict[str, Any], conversation: list[ChatMessage]) -> None:
        self._expire()
        self._entries[response_id] = StoredResponse(body, conversation, self._clock())
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, now the most recently used; None when unknown, deleted or expired."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        """Drop the entries past their time to live (a scan: LRU order is not age order)."""
        deadline = self._clock() - self.ttl_s
        expired = [key for key, entry in self._entries.items() if entry.stored_s < deadline]
        for key in expired:
            del self._entries[key]
