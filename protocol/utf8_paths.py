"""Where in a msgpack frame its first string of invalid UTF-8 lies, said as msgspec says a path.

msgspec's msgpack decoder lets a string's ``UnicodeDecodeError`` through bare (a ``ValueError``,
not a ``msgspec.DecodeError``, and without a path), so a client that sends invalid UTF-8 in any
string (rid, prompt, stop, a tool's name, a grammar's spec) would learn neither that its frame was
refused as malformed nor which field. ``Codec.decode`` calls this walker on that error path only, to
raise a ``msgspec.ValidationError`` naming the field. The walker only reads headers and strings: it
skips every other payload by its length, and keeps its own stack (a frame nested thousands deep
costs no Python recursion).
"""

from __future__ import annotations

from dataclasses import dataclass

# Header byte -> (what follows, bytes of the length field, or of the payload for fixed scalars).
_SIZED = {
    0xC4: ("bin", 1), 0xC5: ("bin", 2), 0xC6: ("bin", 4),
    0xC7: ("ext", 1), 0xC8: ("ext", 2), 0xC9: ("ext", 4),
    0xD9: ("str", 1), 0xDA: ("str", 2), 0xDB: ("str", 4),
    0xDC: ("array", 2), 0xDD: ("array", 4),
    0xDE: ("map", 2), 0xDF: ("map", 4),
}  # fmt: skip
_FIXED = {
    0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8,
    0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,
    0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17,  # fixext: a type byte and 1..16 data bytes
}  # fmt: skip


MAX_PATH_CHARS = 200


class _Malformed(Exception):
    """The frame is not msgpack where the walker reads it (msgspec would have said so first)."""


@dataclass
class _Open:
    """An array or map being read: the path segment that leads to it from its parent, and how
    many of its items (a map: keys and values both) are still to come."""

    segment: str
    is_map: bool
    remaining: int
    index: int = 0
    value_segment: str = ""  # a map's: the segment of the value after the key just read

    @property
    def at_key(self) -> bool:
        return self.is_map and self.remaining % 2 == 0

    def child_segment(self) -> str:
        """The segment of the item read next (a map key's: none, it is "`key` in" the map)."""
        if not self.is_map:
            return f"[{self.index}]"
        return "" if self.at_key else self.value_segment

    def took(self, key: str | None) -> bool:
        """One item read (``key``: a map key's text, when it was a valid string); True when the
        container is complete."""
        if self.at_key:
            self.value_segment = f".{key}" if key is not None and key.isidentifier() else "[...]"
        else:
            self.index += 1
        self.remaining -= 1
        return self.remaining == 0


def invalid_utf8_location(frame: bytes | memoryview) -> str | None:
    """msgspec's location text of the first string in ``frame`` that is not valid UTF-8:
    "`$.messages[0].content`", "`key` in `$.chat_template_kwargs`", "" for the frame itself; None
    when there is none (or the frame is not msgpack before it)."""
    try:
        return _walk(bytes(frame))
    except (_Malformed, IndexError):
        return None


def _walk(data: bytes) -> str | None:
    stack: list[_Open] = []
    pos = 0
    while True:
        kind, start, size = _header(data, pos)
        key = None
        if kind == "str":
            if start + size > len(data):
                raise _Malformed("truncated string")
            try:
                key = data[start : start + size].decode()
            except UnicodeDecodeError:
                return _location(stack)
        if kind in ("array", "map") and size:
            segment = stack[-1].child_segment() if stack else ""
            stack.append(_Open(segment, kind == "map", size * (2 if kind == "map" else 1)))
            pos = start
            continue
        pos = start + (0 if kind in ("array", "map") else size)
        while stack and stack[-1].took(key):  # a finished container is one item of its parent
            stack.pop()
            key = None
        if not stack:
            return None


def _location(stack: list[_Open]) -> str:
    """Where the item read next lies; a path over MAX_PATH_CHARS keeps its ends."""
    path = "$" + "".join(o.segment for o in stack) + (stack[-1].child_segment() if stack else "")
    if len(path) > MAX_PATH_CHARS:
        path = f"{path[: MAX_PATH_CHARS // 2]}...{path[-MAX_PATH_CHARS // 2 :]}"
    if stack and stack[-1].at_key:
        return f"`key` in `{path}`"
    return "" if path == "$" else f"`{path}`"


def _header(data: bytes, pos: int) -> tuple[str, int, int]:
    """(kind, where its payload starts, its size: bytes, or items for an array / pairs for a map)."""
    b = data[pos]
    if b <= 0x7F or b >= 0xE0:
        return "scalar", pos + 1, 0
    if b <= 0x8F:
        return "map", pos + 1, b & 0x0F
    if b <= 0x9F:
        return "array", pos + 1, b & 0x0F
    if b <= 0xBF:
        return "str", pos + 1, b & 0x1F
    if b in _FIXED:
        return "scalar", pos + 1, _FIXED[b]
    if b not in _SIZED:
        raise _Malformed(f"byte 0x{b:02x} starts no msgpack value")
    kind, width = _SIZED[b]
    if pos + 1 + width > len(data):
        raise _Malformed("truncated header")
    size = int.from_bytes(data[pos + 1 : pos + 1 + width], "big")
    if kind == "ext":
        return "scalar", pos + 1 + width, size + 1  # its type byte, then the data
    return ("scalar" if kind == "bin" else kind), pos + 1 + width, size
