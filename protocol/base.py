"""The base of every message between rivulet's own processes (msgpack arrays, see messages.py)."""

from __future__ import annotations

import msgspec


class Msg(msgspec.Struct, tag=True, frozen=True, kw_only=True, array_like=True):
    """Base of every message between rivulet's processes."""
