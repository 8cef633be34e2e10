"""Hypothesis strategies for the client socket's fuzz test: random msgpack values, raw bytes in 1-3
frames, and valid requests with one field replaced by a random value of any type.

msgspec cannot write a string of invalid UTF-8, so ``pack`` is a small msgpack encoder of our own
that can (``InvalidUtf8``); everything else it hands to msgspec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from hypothesis import strategies as st

RID = "\x00rid"  # a valid request's rid until the test gives it a unique one at send time
MAX_NEW_TOKENS = 2  # so generation does not eat the time


class InvalidUtf8(bytes):
    """A msgpack string whose bytes are not valid UTF-8."""


@dataclass(frozen=True)
class Fuzz:
    """One client message: its frames' values (bytes are sent as they are, anything else packed),
    and how it was made."""

    kind: str  # "value", "raw", "valid" or "mutated:<path>"
    frames: tuple[Any, ...]


def pack(value: Any) -> bytes:
    """``value`` as msgpack, ``InvalidUtf8`` as a string of its bytes."""
    if isinstance(value, InvalidUtf8):
        return _header(len(value), 0xA0, 0x1F, (0xD9, 0xDA, 0xDB)) + bytes(value)
    if isinstance(value, list):
        return _header(len(value), 0x90, 0x0F, (None, 0xDC, 0xDD)) + b"".join(map(pack, value))
    if isinstance(value, dict):
        items = b"".join(pack(k) + pack(v) for k, v in value.items())
        return _header(len(value), 0x80, 0x0F, (None, 0xDE, 0xDF)) + items
    return msgspec.msgpack.encode(value)


def _header(n: int, fix: int, fix_max: int, sized: tuple[int | None, int, int]) -> bytes:
    if n <= fix_max:
        return bytes([fix | n])
    for code, width in zip(sized, (1, 2, 4), strict=True):
        if code is not None and n < 2 ** (8 * width):
            return bytes([code]) + n.to_bytes(width, "big")
    raise ValueError(f"{n} items do not fit msgpack")


_BAD_BYTES = st.sampled_from(
    [b"\xff", b"\xed\xa0\x80", b"\xc0\x80", b"\xe2\x82", b"\x80", b"\xf4\x90\x80\x80"]
)
invalid_utf8 = st.builds(
    lambda head, bad, tail: InvalidUtf8(head.encode() + bad + tail.encode()),
    st.text(max_size=4),
    _BAD_BYTES,
    st.text(max_size=4),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=12),
    invalid_utf8,
    st.binary(max_size=12),
    st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=12)),
)
keys = st.one_of(st.text(max_size=8), invalid_utf8, st.integers(-5, 5), st.none(), st.binary(max_size=4))
# Up to three levels deep, not st.recursive: that drew 4x slower, and deep nesting has its own tests
# (tests/protocol/test_utf8_paths.py).
_flat = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(keys, scalars, max_size=3))
values = st.one_of(scalars, st.lists(_flat, max_size=3), st.dictionaries(keys, _flat, max_size=3))

# The optional sampling fields come in a few fixed sets (drawing each field drew 8x slower); the
# mutations vary them.
_SAMPLING_EXTRAS = [
    {},
    {"top_k": 5, "top_p": 0.9, "min_p": 0.05, "seed": 7},
    {"stop": ["a", "the"], "stop_token_ids": [7]},
    {"presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "logit_bias": {5: 1.0}},
    {"min_tokens": 1, "ignore_eos": True},
    {"grammar": {"kind": "regex", "spec": "[ab]{1,3}"}},
]
_SAMPLING = st.builds(
    lambda max_new, temperature, extra: {"max_new_tokens": max_new, "temperature": temperature, **extra},
    st.integers(1, MAX_NEW_TOKENS),
    st.sampled_from([0.0, 0.8]),
    st.sampled_from(_SAMPLING_EXTRAS),
)
_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
_BASES = st.one_of(
    st.fixed_dictionaries({"prompt": st.sampled_from(["Hello", "The sky is", "héllo 🌍"])}),
    st.fixed_dictionaries({"input_ids": st.lists(st.integers(3, 1000), min_size=1, max_size=6)}),
    st.fixed_dictionaries(
        {"messages": st.just([{"role": "user", "content": "hi"}])},
        optional={"tools": st.just([_TOOL]), "tool_choice": st.sampled_from(["auto", "none"])},
    ),
)
valid_requests = st.builds(
    lambda base, sampling, extra: {"type": "generate", "rid": RID, **base, "sampling": sampling, **extra},
    _BASES,
    _SAMPLING,
    st.fixed_dictionaries(
        {},
        optional={
            "stream": st.booleans(),
            "logprobs": st.booleans(),
            "cache_salt": st.text(max_size=4),
            "n": st.integers(1, 3),
        },
    ),
)


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a request a value sits (map values and list items), outermost first."""
    inner: list[tuple[Any, ...]] = []
    if isinstance(value, dict):
        for k, v in value.items():
            inner += [(*path, k), *_paths(v, (*path, k))]
    elif isinstance(value, list):
        for i, v in enumerate(value):
            inner += [(*path, i), *_paths(v, (*path, i))]
    return inner


def _replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replaced(value[head], rest, new)}
    return [_replaced(v, rest, new) if i == head else v for i, v in enumerate(value)]


@st.composite
def mutated_requests(draw: st.DrawFn) -> Fuzz:
    """A valid request with one field (at any depth) replaced by a random value of any type, or
    one unknown field added."""
    req = draw(valid_requests)
    path = draw(st.sampled_from([*_paths(req), ("unknown_field",)]))
    new = _replaced(req, path, draw(values)) if path[0] in req else {**req, path[0]: draw(values)}
    return Fuzz(f"mutated:{'.'.join(map(str, path))}", (new,))


messages = st.one_of(
    st.builds(lambda v: Fuzz("value", (v,)), values),
    st.builds(
        lambda frames: Fuzz("raw", tuple(frames)), st.lists(st.binary(max_size=48), min_size=1, max_size=3)
    ),
    mutated_requests(),
    mutated_requests(),
    st.builds(lambda req: Fuzz("valid", (req,)), valid_requests),
)


def frames_of(message: Fuzz, rid: str) -> list[bytes]:
    """The frames to send, ``RID`` given as ``rid``."""
    return [
        f if isinstance(f, bytes) and message.kind == "raw" else pack(_with_rid(f, rid))
        for f in message.frames
    ]


def _with_rid(value: Any, rid: str) -> Any:
    if isinstance(value, dict) and value.get("rid") == RID:
        return {**value, "rid": rid}
    return value
