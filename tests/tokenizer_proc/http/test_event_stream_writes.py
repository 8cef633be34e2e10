"""EventStream's writes (choices.py): a reply's events are sent in the process loop's own call while
the stream's writer waits, unless the server's send would wait (flow control): then the writer
finishes that send, and sends what gathered meanwhile after it, in order. A send that raises is the
handler's error. Fakes stand in for the handles, the response shape and the server."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any, cast

import pytest

from protocol.messages import FinishReason, GenerateOutput
from tokenizer_proc.http.bridge import Listener, RequestHandle
from tokenizer_proc.http.choices import SERVER_SEND, EventStream
from tokenizer_proc.http.completion_bodies import DONE_EVENT, ResponseShape


class FakeHandle:
    def __init__(self) -> None:
        self.finished = False
        self.listener: Listener | None = None
        self.closed = False

    def listen(self, listener: Listener) -> None:
        self.listener = listener

    async def abort(self) -> None:
        pass

    async def close(self) -> None:
        self.closed = True


class FakeShape:
    """One event per reply with text: its text; no usage chunk."""

    def events(self, index: int, reply: GenerateOutput) -> list[bytes]:
        return [f"{index}:{reply.text};".encode()] if reply.text else []

    def usage_event(self, usages: list[Any]) -> bytes | None:
        return None


class FakeServer:
    """The server's send: records each message; while ``paused`` is set, a send waits for it."""

    def __init__(self, fail_on: bytes | None = None) -> None:
        self.sent: list[MutableMapping[str, Any]] = []
        self.paused: asyncio.Future[None] | None = None
        self.fail_on = fail_on

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if self.paused is not None:
            await self.paused
        if self.fail_on is not None and message.get("body") == self.fail_on:
            raise RuntimeError("the connection broke")
        self.sent.append(message)

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


async def _never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def _start(server: FakeServer, choices: int = 1) -> tuple[list[FakeHandle], asyncio.Task[None]]:
    handles = [FakeHandle() for _ in range(choices)]
    stream = EventStream(cast(list[RequestHandle], handles), cast(ResponseShape, FakeShape()))
    scope = {"type": "http", SERVER_SEND: server.send}
    task = asyncio.create_task(stream(scope, _never_disconnects, server.send))
    return handles, task


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _reply(text: str, index: int = 0, finish: FinishReason | None = None) -> GenerateOutput:
    return GenerateOutput(rid="r", text=text, index=index, finish_reason=finish)


def test_a_reply_is_written_in_the_delivering_call_while_the_writer_waits() -> None:
    async def run() -> None:
        server = FakeServer()
        (handle,), task = _start(server)
        await _settle()
        assert handle.listener is not None
        handle.listener(_reply("a"))
        assert server.bodies() == [b"0:a;"]  # no task step between: written in the call
        handle.listener(_reply(""))  # shows no text: nothing written
        handle.listener(_reply("b"))
        assert server.bodies() == [b"0:a;", b"0:b;"]
        handle.listener(_reply("c", finish=FinishReason.LENGTH))
        await asyncio.wait_for(task, 5)
        assert server.bodies() == [b"0:a;", b"0:b;", b"0:c;" + DONE_EVENT]
        assert [m.get("more_body") for m in server.sent[1:]] == [True, True, False]
        assert handle.closed

    asyncio.run(run())


def test_a_send_that_waits_is_finished_by_the_writer_before_what_came_after() -> None:
    async def run() -> None:
        server = FakeServer()
        handles, task = _start(server, choices=2)
        await _settle()
        first, second = (h.listener for h in handles)
        assert first is not None and second is not None
        first(_reply("a"))
        server.paused = asyncio.get_running_loop().create_future()  # flow control pauses the socket
        first(_reply("b"))  # its send begins and waits
        second(_reply("x", index=1))  # the writer is busy: gathered
        first(_reply("c"))
        await _settle()
        assert server.bodies() == [b"0:a;"]
        server.paused.set_result(None)
        server.paused = None
        await _settle()
        assert server.bodies() == [b"0:a;", b"0:b;", b"1:x;0:c;"]  # in order, the gathered in one write
        second(_reply("y", index=1))  # the writer waits again: written in the call
        assert server.bodies()[-1] == b"1:y;"
        first(_reply("", finish=FinishReason.STOP))
        second(_reply("z", index=1, finish=FinishReason.LENGTH))
        await asyncio.wait_for(task, 5)
        assert b"".join(server.bodies()) == b"0:a;0:b;1:x;0:c;1:y;1:z;" + DONE_EVENT
        assert server.sent[-1]["more_body"] is False

    asyncio.run(run())


@pytest.mark.parametrize("paused", [False, True])
def test_a_send_that_raises_is_the_handlers_error(paused: bool) -> None:
    async def run() -> None:
        server = FakeServer(fail_on=b"0:b;")
        (handle,), task = _start(server)
        await _settle()
        assert handle.listener is not None
        handle.listener(_reply("a"))
        if paused:
            server.paused = asyncio.get_running_loop().create_future()
        handle.listener(_reply("b"))  # raises in the call, or in the writer once unpaused
        if server.paused is not None:
            server.paused.set_result(None)
            server.paused = None
        with pytest.raises(RuntimeError, match="the connection broke"):
            await asyncio.wait_for(task, 5)
        assert server.bodies() == [b"0:a;"]
        assert handle.closed

    asyncio.run(run())


def test_a_waiting_send_is_cancelled_with_the_stream() -> None:
    async def run() -> None:
        server = FakeServer()
        (handle,), task = _start(server)
        await _settle()
        assert handle.listener is not None
        server.paused = asyncio.get_running_loop().create_future()
        handle.listener(_reply("a"))
        await _settle()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert server.paused.cancelled()  # the send's wait was cancelled, not left behind
        assert server.bodies() == [] and handle.closed

    asyncio.run(run())
