"""Invalid UTF-8 anywhere in a frame is a ValidationError naming its field; no frame makes a Codec
raise anything but msgspec's errors."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest

from protocol import ClientRequest, TokenizedRequest, ToScheduler, WorkerSampling
from protocol.transport import Codec
from protocol.utf8_paths import invalid_utf8_location

BAD = "\udcff"  # a placeholder string the tests swap for the bytes 0xff 0xfe (invalid UTF-8)


def _with_invalid_utf8(value: dict[str, Any]) -> bytes:
    """``value`` as msgpack with its one BAD string (a key or a value) replaced by invalid UTF-8."""
    placeholder = "PLACEHOLDER"
    frame = msgspec.msgpack.encode(_replace(value, BAD, placeholder))
    assert frame.count(placeholder.encode()) == 1, "one BAD string per case"
    return frame.replace(msgspec.msgpack.encode(placeholder), b"\xa2\xff\xfe")


def _replace(value: Any, old: str, new: str) -> Any:
    if isinstance(value, dict):
        return {_replace(k, old, new): _replace(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace(v, old, new) for v in value]
    return new if value == old else value


def _generate(**fields: Any) -> dict[str, Any]:
    return {"type": "generate", "rid": "r1", **fields}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CASES: list[tuple[dict[str, Any], str]] = [
    (_generate(rid=BAD, prompt="x"), "`$.rid`"),
    (_generate(prompt=BAD), "`$.prompt`"),
    (_generate(prompt="x", sampling={"stop": ["a", BAD]}), "`$.sampling.stop[1]`"),
    (_generate(messages=[{"role": "user", "content": BAD}]), "`$.messages[0].content`"),
    (_generate(messages=[{"role": BAD, "content": "x"}]), "`$.messages[0].role`"),
    (
        _generate(messages=[{"role": "user", "content": "x"}], tools=[{**TOOL, "function": {"name": BAD}}]),
        "`$.tools[0].function.name`",
    ),
    (
        _generate(
            messages=[{"role": "user", "content": "x"}],
            tools=[{"function": {"name": "f", "parameters": {"properties": {"a": {"type": BAD}}}}}],
        ),
        "`$.tools[0].function.parameters.properties.a.type`",
    ),
    (
        _generate(prompt="x", sampling={"grammar": {"kind": "regex", "spec": BAD}}),
        "`$.sampling.grammar.spec`",
    ),
    (_generate(prompt="x", sampling={"grammar": {"kind": BAD}}), "`$.sampling.grammar.kind`"),
    (
        _generate(messages=[{"role": "user", "content": "x"}], chat_template_kwargs={BAD: 1}),
        "`key` in `$.chat_template_kwargs`",
    ),
    (_generate(prompt="x", cache_salt=BAD), "`$.cache_salt`"),
    ({"type": BAD, "rid": "r1"}, "`$.type`"),
    ({"type": "abort", "rid": BAD}, "`$.rid`"),
]


@pytest.mark.parametrize(("value", "where"), CASES, ids=[c[1] for c in CASES])
def test_invalid_utf8_names_its_field(value: dict[str, Any], where: str) -> None:
    frame = _with_invalid_utf8(value)
    assert invalid_utf8_location(frame) == where
    with pytest.raises(
        msgspec.ValidationError, match=f"Invalid UTF-8 in a string .* - at {re.escape(where)}$"
    ):
        Codec(ClientRequest).decode(frame)


def test_the_issues_frames_are_validation_errors() -> None:
    codec: Codec[ClientRequest] = Codec(ClientRequest)
    with pytest.raises(msgspec.ValidationError):
        codec.decode(bytes.fromhex("a1ff"))  # a bare string of invalid UTF-8
    with pytest.raises(msgspec.ValidationError, match=r"at `\$\.rid`"):
        codec.decode(bytes.fromhex("82a474797065a867656e6572617465a3726964a1ff"))


def test_the_walker_reads_every_msgpack_kind_up_to_the_string() -> None:
    before = [None, True, 1.5, -3, 2**40, -(2**40), b"bytes", msgspec.msgpack.Ext(5, b"x" * 300), "x" * 300]
    frame = _with_invalid_utf8({"a": before, "b": {"c": [[], {}], "d": BAD}})
    assert invalid_utf8_location(frame) == "`$.b.d`"
    assert invalid_utf8_location(msgspec.msgpack.encode({"a": before})) is None  # valid throughout
    assert invalid_utf8_location(b"\xdc\xff\xff") is None  # truncated before any string
    assert invalid_utf8_location(b"\xa2\xff\xfe") == ""  # the frame itself


def test_deep_nesting_is_a_decode_error() -> None:
    """msgspec raises RecursionError past its depth limit (inside a dict[str, Any] field here)."""
    head = msgspec.msgpack.encode(_generate(prompt="x", chat_template_kwargs={"a": 0}))[:-1]
    frame = head + b"\x91" * 100_000 + b"\x01"
    with pytest.raises(msgspec.DecodeError, match="RecursionError"):
        Codec(ClientRequest).decode(frame)
    path = invalid_utf8_location(b"\x91" * 5000 + b"\xa2\xff\xfe")  # our walker keeps its own stack
    assert path is not None and path.startswith("`$[0][0]") and len(path) < 250


def test_internal_channels_check_strings_too() -> None:
    sampler = WorkerSampling(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=1)
    req = TokenizedRequest(
        rid=5, input_ids=[1], max_new_tokens=4, stop_token_ids=[], sampler=sampler, cache_salt="SALT"
    )
    frame = Codec(ToScheduler).encode(req).replace(msgspec.msgpack.encode("SALT"), b"\xa2\xff\xfe")
    with pytest.raises(msgspec.ValidationError, match=r"at `\$\[6\]`"):  # [0] is the tag
        Codec(ToScheduler).decode(frame)
