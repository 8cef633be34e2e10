"""A streamed Responses API response that fails part-way, read by the official ``openai`` package's
stream helper: the real ResponseEventStream and OutputItems over a scripted engine handle (an
engine error reply, or a reply our own code fails on), its SSE bytes served through httpx2's mock
transport. Every item added is closed, then ``error`` and ``response.failed`` end the stream."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

import httpx2  # the openai package's HTTP client (its own dependency)
import msgspec
import openai
import pytest
from openai.lib.streaming.responses import ResponseStream

from protocol.chat import ToolCallDelta
from protocol.messages import FinishReason, GenerateOutput
from tokenizer_proc.http.responses_output import OutputItems
from tokenizer_proc.http.responses_run import ResponseRun, echo_fields
from tokenizer_proc.http.responses_schema import ResponsesRequest
from tokenizer_proc.http.responses_store import ResponseStore
from tokenizer_proc.http.responses_stream import ResponseEventStream
from tokenizer_proc.http.schemas import decode_body


class _Texts:
    def text_of(self, token_id: int) -> str:
        return f"<{token_id}>"

    def bytes_of(self, token_id: int) -> bytes:
        return self.text_of(token_id).encode()


class _ScriptedHandle:
    """RequestHandle's surface over a fixed list of replies."""

    def __init__(self, replies: list[GenerateOutput]) -> None:
        self.replies = list(replies)
        self.finished = False
        self.closed = False

    async def next(self) -> GenerateOutput:
        reply = self.replies.pop(0)
        self.finished = reply.finish_reason is not None
        return reply

    async def abort(self) -> None:
        raise AssertionError("the client never disconnects here")

    async def close(self) -> None:
        self.closed = True


def _stream_bytes(replies: list[GenerateOutput], store: ResponseStore) -> tuple[bytes, _ScriptedHandle]:
    body = decode_body(msgspec.json.encode({"input": "hi", "stream": True}), ResponsesRequest)
    output = OutputItems(_Texts(), logprobs=False)  # type: ignore[arg-type]
    run = ResponseRun("resp_1", echo_fields(body, "tiny"), [], output, store, count_tokens=len)
    handle = _ScriptedHandle(replies)
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # the client stays
        raise AssertionError("unreachable")

    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body":
            chunks.append(message["body"])

    stream = ResponseEventStream(handle, run)  # type: ignore[arg-type]
    asyncio.run(stream({"type": "http"}, receive, send))
    return b"".join(chunks), handle


def _through_the_helper(sse: bytes) -> tuple[list[Any], ResponseStream[Any]]:
    def reply(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=sse)

    http = httpx2.Client(transport=httpx2.MockTransport(reply))
    oai = openai.OpenAI(base_url="http://engine/v1", api_key="-", http_client=http, max_retries=0)
    with oai.responses.stream(model="tiny", input="hi") as stream:
        return list(stream), stream


TEXT = [GenerateOutput(rid="r", text="Hel"), GenerateOutput(rid="r", text="lo")]
CALL = [
    GenerateOutput(rid="r", tool_calls=[ToolCallDelta(index=0, id="call_a", name="add", arguments='{"a"')])
]
ENGINE_ERROR = GenerateOutput(rid="r", finish_reason=FinishReason.ERROR, error="the forward pass failed")
# a call's later piece for a call that never started: OutputItems fails on it (a fault of ours)
BAD_PIECE = GenerateOutput(rid="r", tool_calls=[ToolCallDelta(index=3, arguments="}")])


@pytest.mark.parametrize(
    ("replies", "open_type", "message"),
    [
        (TEXT + [ENGINE_ERROR], "message", "the forward pass failed"),
        (CALL + [ENGINE_ERROR], "function_call", "the forward pass failed"),
        (TEXT + [BAD_PIECE], "message", "internal error: KeyError(3)"),
    ],
    ids=["engine error in text", "engine error in a call", "a fault of ours"],
)
def test_a_failure_mid_stream_closes_its_item_then_error_and_failed(
    replies: list[GenerateOutput], open_type: str, message: str
) -> None:
    store = ResponseStore()
    sse, handle = _stream_bytes(replies, store)
    events, stream = _through_the_helper(sse)
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.output_item.done", "error", "response.failed"], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.id for i in added] == [i.id for i in done] and [i.type for i in done] == [open_type]
    assert done[0].status == "incomplete"
    error, failed = events[-2], events[-1].response
    assert (error.code, error.message, error.param) == ("server_error", message, None)
    assert failed.status == "failed" and failed.id == events[0].response.id
    assert failed.error is not None and (failed.error.code, failed.error.message) == ("server_error", message)
    assert [o.model_dump() for o in failed.output] == [i.model_dump() for i in done]
    with pytest.raises(RuntimeError, match="response.completed"):
        stream.get_final_response()  # the helper's answer to a failed response: there is no final one
    assert handle.closed and store.get("resp_1") is None, "the engine request ended, nothing stored"
