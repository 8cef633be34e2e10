"""The clients against a fake engine: a ROUTER socket driven by the test."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from client import DEFAULT_ENDPOINT, AsyncClient, Client, EngineError, EngineUnreachable, default_endpoint
from client.__main__ import main
from protocol.chat import NamedToolChoice, ToolCallDelta
from protocol.messages import (
    AbortRequest,
    ClientRequest,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    Usage,
)
from protocol.transport import Codec, make_socket


class FakeEngine:
    """A bound ROUTER that records requests and sends whatever replies the test asks for."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.ROUTER, endpoint, bind=True)
        self.codec: Codec[ClientRequest] = Codec(ClientRequest)

    def recv(self) -> tuple[bytes, ClientRequest]:
        assert self.sock.poll(5000), "the client sent nothing"
        identity, payload = self.sock.recv_multipart()
        return identity, self.codec.decode(payload)

    def reply(self, identity: bytes, out: GenerateOutput) -> None:
        self.sock.send_multipart([identity, self.codec.encode(out)])

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def endpoint() -> Iterator[str]:
    run_dir = tempfile.mkdtemp(prefix="rv-cl-")
    yield f"ipc://{run_dir}/client.sock"
    shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def engine(endpoint: str) -> Iterator[FakeEngine]:
    fake = FakeEngine(endpoint)
    yield fake
    fake.close()


def _delta(
    rid: str, text: str, finish: FinishReason | None = None, error: str | None = None
) -> GenerateOutput:
    usage = Usage(prompt_tokens=1, completion_tokens=2) if finish is not None else None
    return GenerateOutput(rid=rid, text=text, finish_reason=finish, usage=usage, error=error)


def test_nothing_listening_fails_fast_naming_the_endpoint(
    endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """No engine at the endpoint: the request fails once no handshake came within the connect
    timeout, not after the reply timeout (300 s by default), and says so."""
    with Client(endpoint, connect_timeout_s=0.2) as client:
        with pytest.raises(EngineUnreachable, match=f"nothing is listening at {endpoint}"):
            client.generate("hello")
        with pytest.raises(EngineUnreachable, match="nothing is listening"):
            next(iter(client.generate("hello", stream=True)))
    assert main(["hello", "--endpoint", endpoint]) == 1  # the CLI, at the default connect timeout
    assert f"nothing is listening at {endpoint}" in capsys.readouterr().err


def test_async_nothing_listening_fails_fast(endpoint: str) -> None:
    async def run() -> None:
        async with AsyncClient(endpoint, connect_timeout_s=0.2) as client:
            with pytest.raises(EngineUnreachable, match=f"nothing is listening at {endpoint}"):
                await client.generate("hello")

    asyncio.run(run())


def _answer_after(engine: FakeEngine, delay_s: float, requests: int = 1) -> threading.Thread:
    """A thread that answers the next ``requests`` GenerateRequests (not aborts, nor a prompt
    "silent"), each ``delay_s`` after it came."""

    def serve() -> None:
        answered = 0
        while answered < requests:
            ident, req = engine.recv()
            if isinstance(req, GenerateRequest) and req.prompt != "silent":
                time.sleep(delay_s)
                engine.reply(ident, _delta(req.rid, "late", FinishReason.STOP))
                answered += 1

    thread = threading.Thread(target=serve)
    thread.start()
    return thread


def test_a_first_reply_slower_than_the_connect_timeout_is_waited_for(
    engine: FakeEngine, endpoint: str
) -> None:
    """The connect timeout bounds the wait for an engine to answer (ZMQ's handshake), not for a
    reply: a long prefill's first token may come much later."""
    thread = _answer_after(engine, 1.5, requests=2)
    try:
        with Client(endpoint, timeout_s=30.0, connect_timeout_s=0.5) as client:
            assert client.generate("slow").text == "late"

        async def run() -> None:
            async with AsyncClient(endpoint, timeout_s=30.0, connect_timeout_s=0.5) as client:
                reply = await client.generate("slow")
                assert reply.text == "late"

        asyncio.run(run())
    finally:
        thread.join(10)


def test_timeout_once_the_engine_answered(engine: FakeEngine, endpoint: str) -> None:
    """An engine that answered once and then stays silent: the reply timeout, a TimeoutError."""
    with Client(endpoint, timeout_s=2.0) as client:
        _answer_after(engine, 0.0)  # the first request only
        assert client.generate("first").text == "late"
        with pytest.raises(TimeoutError, match="no reply"):
            client.generate("silent")

    async def run() -> None:
        async with AsyncClient(endpoint, timeout_s=2.0) as client:
            assert (await client.generate("first")).text == "late"
            with pytest.raises(TimeoutError, match="no reply"):
                await client.generate("silent")

    thread = _answer_after(engine, 0.0)
    try:
        asyncio.run(run())
    finally:
        thread.join(10)


def test_interleaved_streams_are_demultiplexed(engine: FakeEngine, endpoint: str) -> None:
    with Client(endpoint, timeout_s=5.0) as client:
        a = client.generate("first", stream=True, rid="a", temperature=0.0, stop=["x"])
        b = client.generate(messages=[{"role": "user", "content": "hi"}], stream=True, rid="b")
        (ident, req_a), (_, req_b) = engine.recv(), engine.recv()
        assert isinstance(req_a, GenerateRequest) and isinstance(req_b, GenerateRequest)
        assert (req_a.prompt, req_a.sampling.temperature, req_a.sampling.stop) == ("first", 0.0, ["x"])
        assert req_b.messages is not None and req_b.messages[0].content == "hi"
        for out in [_delta("b", "B1"), _delta("a", "A1"), _delta("b", "B2", FinishReason.STOP)]:
            engine.reply(ident, out)
        engine.reply(ident, _delta("a", "A2", FinishReason.ABORT))  # ABORT is a normal ending
        assert [d.text for d in a] == ["A1", "A2"]
        assert [(d.text, d.finish_reason) for d in b] == [("B1", None), ("B2", FinishReason.STOP)]


def test_error_reply_raises_and_abandoned_stream_aborts(engine: FakeEngine, endpoint: str) -> None:
    with Client(endpoint, timeout_s=5.0) as client:
        stream = client.generate("x", stream=True, rid="e")
        ident, _ = engine.recv()
        engine.reply(ident, _delta("e", "", FinishReason.ERROR, error="sampling.top_p must be in (0, 1]"))
        with pytest.raises(EngineError, match="top_p"):
            next(stream)

        stream = client.generate("y", stream=True, rid="gone")
        engine.recv()
        engine.reply(ident, _delta("gone", "partial"))
        assert next(stream).text == "partial"
        stream.close()
        _, abort = engine.recv()
        assert abort == AbortRequest(rid="gone")
        with pytest.raises(ValueError, match="in flight"):
            client.generate("z", stream=True, rid="dup")
            client.generate("z", stream=True, rid="dup")


def test_rid_less_error_reaches_the_waiter(engine: FakeEngine, endpoint: str) -> None:
    with Client(endpoint, timeout_s=5.0) as client:
        stream = client.generate("x", stream=True)
        ident, _ = engine.recv()
        engine.reply(ident, _delta("", "", FinishReason.ERROR, error="malformed request"))
        with pytest.raises(EngineError, match="malformed"):
            next(stream)


def test_async_client_demultiplexes_concurrent_requests(engine: FakeEngine, endpoint: str) -> None:
    def serve() -> None:
        requests = [engine.recv() for _ in range(3)]
        ident = requests[0][0]
        by_rid = {req.rid: req for _, req in requests}
        assert set(by_rid) == {"s", "n", "bad"}
        engine.reply(ident, _delta("bad", "", FinishReason.ERROR, error="prompt must not be empty"))
        engine.reply(ident, _delta("s", "one "))
        engine.reply(ident, _delta("n", "whole answer", FinishReason.LENGTH))
        engine.reply(ident, _delta("s", "two", FinishReason.STOP))

    async def run() -> None:
        async with AsyncClient(endpoint, timeout_s=5.0) as client:

            async def streamed() -> str:
                stream = await client.generate("s", stream=True, rid="s")
                return "".join([d.text async for d in stream])

            async def bad() -> None:
                with pytest.raises(EngineError, match="prompt"):
                    await client.generate("", rid="bad")

            text, whole, _ = await asyncio.gather(streamed(), client.generate("n", rid="n"), bad())
            assert text == "one two"
            assert isinstance(whole, GenerateOutput) and whole.text == "whole answer"

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        asyncio.run(run())
    finally:
        thread.join(10)


def test_default_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RIVULET_ENDPOINT", raising=False)
    assert default_endpoint() == DEFAULT_ENDPOINT == "ipc:///tmp/rivulet/client.sock"
    monkeypatch.setenv("RIVULET_ENDPOINT", "tcp://127.0.0.1:5555")
    assert default_endpoint() == "tcp://127.0.0.1:5555"


def test_cli_streams_a_chat_completion(
    engine: FakeEngine, endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[GenerateRequest] = []

    def serve() -> None:
        ident, req = engine.recv()
        assert isinstance(req, GenerateRequest)
        seen.append(req)
        for out in [_delta(req.rid, "Paris"), _delta(req.rid, " is.", FinishReason.STOP)]:
            engine.reply(ident, out)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        code = main(["What is the capital of France?", "--endpoint", endpoint, "--max-new-tokens", "9"])
    finally:
        thread.join(10)
    assert code == 0
    assert capsys.readouterr().out == "Paris is.\n"
    (req,) = seen
    assert req.messages is not None and req.messages[0].content == "What is the capital of France?"
    assert (req.prompt, req.sampling.temperature, req.sampling.max_new_tokens, req.stream) == (
        None,
        0.0,
        9,
        True,
    )


def test_cli_raw_prompt_and_engine_error(
    engine: FakeEngine, endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    def serve() -> None:
        ident, req = engine.recv()
        assert isinstance(req, GenerateRequest) and req.prompt == "Once upon" and req.messages is None
        engine.reply(ident, _delta(req.rid, "", FinishReason.ERROR, error="engine is shutting down"))

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        code = main(["Once upon", "--raw", "--endpoint", endpoint])
    finally:
        thread.join(10)
    assert code == 1
    assert "engine is shutting down" in capsys.readouterr().err


def test_messages_are_checked_client_side(endpoint: str) -> None:
    with Client(endpoint, timeout_s=0.2) as client, pytest.raises(msgspec.ValidationError, match="role"):
        client.generate(messages=[{"content": "no role"}])


def test_chat_with_tools_travels_and_tool_calls_come_back(engine: FakeEngine, endpoint: str) -> None:
    tools: list[dict[str, Any]] = [
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    ]
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]  # fmt: skip
    with Client(endpoint, timeout_s=5.0) as client:
        stream = client.generate(
            messages=history, tools=tools, tool_choice={"type": "function", "function": {"name": "add"}},
            chat_template_kwargs={"enable_thinking": False}, stream=True, rid="t",
        )  # fmt: skip
        ident, req = engine.recv()
        assert isinstance(req, GenerateRequest) and req.tools is not None and req.messages is not None
        assert req.tools[0].function.name == "add" and req.tools[0].function.parameters == {"type": "object"}
        assert isinstance(req.tool_choice, NamedToolChoice) and req.tool_choice.function.name == "add"
        assert req.chat_template_kwargs == {"enable_thinking": False}
        calls = req.messages[1].tool_calls
        assert (
            req.messages[1].content is None
            and calls is not None
            and calls[0].function.arguments == '{"a": 1}'
        )
        assert req.messages[2].tool_call_id == "call_1"
        piece = ToolCallDelta(index=0, id="call_9", name="add", arguments='{"a"')
        engine.reply(ident, GenerateOutput(rid="t", tool_calls=[piece], reasoning_text="hmm"))
        engine.reply(ident, _delta("t", "", FinishReason.TOOL_CALLS))
        first, last = list(stream)
        assert first.tool_calls == [piece] and first.reasoning_text == "hmm"
        assert last.finish_reason is FinishReason.TOOL_CALLS
