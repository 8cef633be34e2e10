"""No client frame, of any shape, makes the Frontend raise: a fault handling one message is that
client's error reply (when its rid can be read), and the requests of others go on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import msgspec
import pytest

from protocol.messages import FinishReason, FinishReq, GenerateOutput, TokenBatch, TokenizedRequest
from tokenizer_proc.frontend import Frontend, rid_of
from tokenizer_proc.model_info import ModelInfo
from tokenizer_proc.outbox import Outbox

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CLIENT = b"client-a"


@pytest.fixture
def frontend(tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo) -> Frontend:
    return Frontend(tokenizer, model_info, seed=0)


def _request(**fields: Any) -> bytes:
    return msgspec.msgpack.encode({"type": "generate", "rid": "r1", "prompt": "Tell me", **fields})


def _only_reply(out: Outbox) -> GenerateOutput:
    ((client, reply),) = out.replies
    assert client == CLIENT and reply.finish_reason is FinishReason.ERROR and reply.error, reply
    return reply


def _submit(frontend: Frontend, rid: str) -> TokenizedRequest:
    out = frontend.on_client_frames([CLIENT, _request(rid=rid)])
    (req,) = out.to_scheduler
    assert out.replies == [] and isinstance(req, TokenizedRequest)
    return req


def _boom(*args: object, **kwargs: object) -> NoReturn:
    raise RuntimeError("a bug")


def test_the_issues_frames_are_answered(frontend: Frontend) -> None:
    reply = _only_reply(frontend.on_client_frames([CLIENT, bytes.fromhex("a1ff")]))
    assert reply.rid == "" and "malformed" in (reply.error or "")
    frame = bytes.fromhex("82a474797065a867656e6572617465a3726964a1ff")  # rid: invalid UTF-8
    reply = _only_reply(frontend.on_client_frames([CLIENT, frame]))
    assert reply.rid == "" and "Invalid UTF-8" in (reply.error or "") and "`$.rid`" in (reply.error or "")
    _submit(frontend, "r1")  # still serving


def test_invalid_utf8_in_a_field_is_answered_under_the_rid(frontend: Frontend) -> None:
    frame = _request(prompt="PLACEHOLDER").replace(msgspec.msgpack.encode("PLACEHOLDER"), b"\xa2\xff\xfe")
    reply = _only_reply(frontend.on_client_frames([CLIENT, frame]))
    assert reply.rid == "r1" and "`$.prompt`" in (reply.error or "")


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        bytes.fromhex("a1ff"),
        b"\x91" * 100_000,
        b"\x81\xa3rid" + b"\x91" * 100_000,
        _request(rid=5),
    ],
)
def test_rid_of_any_frame_is_a_string(payload: bytes) -> None:
    assert rid_of(payload) == ""


def test_rid_of_skips_what_it_does_not_read() -> None:
    frame = _request(prompt="PLACEHOLDER").replace(msgspec.msgpack.encode("PLACEHOLDER"), b"\xa2\xff\xfe")
    assert rid_of(frame) == "r1"


def test_a_bug_in_a_handler_is_the_clients_error_reply(
    frontend: Frontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(frontend.router, "route", _boom)  # after the request entered the table
    reply = _only_reply(frontend.on_client_frames([CLIENT, _request()]))
    assert reply.rid == "r1" and "a bug" in (reply.error or "")
    assert len(frontend.requests) == 0  # nothing it left behind
    monkeypatch.undo()
    _submit(frontend, "r1")  # the rid is free again, and the engine serves on


def test_a_bug_without_a_readable_rid_is_a_logged_drop(
    frontend: Frontend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(frontend, "_dispatch_client_frames", _boom)
    assert frontend.on_client_frames([CLIENT, b"\xc1"]) == Outbox()
    assert "cannot be read" in caplog.text


def test_a_fault_on_one_row_fails_that_request_alone(
    frontend: Frontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = _submit(frontend, "a"), _submit(frontend, "b")
    state_a = frontend.requests._states[a.rid]
    monkeypatch.setattr(state_a, "advance", _boom)
    batch = TokenBatch(
        rids=[a.rid, b.rid],
        token_ids=[5, 6],
        logprobs=[0.0, 0.0],
        finished=[None, None],
        cached_tokens=[0, 0],
    )
    out = frontend.on_scheduler_msg(batch)
    ((client, reply),) = out.replies  # b is not streaming: no reply yet, but its token was taken
    assert client == CLIENT and reply.rid == "a" and reply.finish_reason is FinishReason.ERROR
    assert out.to_scheduler == [FinishReq(rid=a.rid, reason=FinishReason.ABORT)]
    assert len(frontend.requests) == 1
    finish = TokenBatch(
        rids=[b.rid], token_ids=[2], logprobs=[0.0], finished=[FinishReason.STOP], cached_tokens=[0]
    )
    ((_, done),) = frontend.on_scheduler_msg(finish).replies
    assert done.rid == "b" and done.finish_reason is FinishReason.STOP and done.token_ids == [6, 2]
