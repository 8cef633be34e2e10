"""Streamed completions in-process (no engine): the SSE bytes a client reads, written by the stream's
own writer as replies are delivered (choices.EventStream), against the OpenAI chunks the replies make
one by one. Real Frontend, tokenizer and app; the scheduler's TokenBatches are fed by the test."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from gpu_worker.weights.model_files import resolve_model
from protocol.messages import (
    EngineStats,
    FinishReason,
    FinishReq,
    GenerateOutput,
    RequestError,
    TokenBatch,
    TokenizedRequest,
    ToTokenizer,
)
from protocol.transport import Codec
from tokenizer_proc.frontend import Frontend
from tokenizer_proc.http.app import HttpSettings, build_app
from tokenizer_proc.http.bridge import HttpBridge
from tokenizer_proc.http.completion_bodies import ResponseShape
from tokenizer_proc.model_info import load_tokenizer, read_model_info
from tokenizer_proc.outbox import Outbox
from tokenizer_proc.token_bytes import TokenTexts

TEXT = "Hello world, this is a small test of streamed text."


@pytest.fixture(scope="module")
def frontend_parts() -> tuple[Any, Any]:
    path: Path = resolve_model(None)
    tokenizer = load_tokenizer(str(path))
    return tokenizer, read_model_info(str(path), tokenizer)


class Engine:
    """The app with a scheduler the test drives: ``step`` sends one TokenBatch of the given rows
    through the msgpack codec, as the process loop does, and delivers the replies."""

    def __init__(self, parts: tuple[Any, Any]) -> None:
        tokenizer, info = parts
        self.frontend = Frontend(tokenizer, info, seed=0)
        self.frontend.on_scheduler_msg(EngineStats(num_running=0, num_waiting=0, num_pages=4, free_pages=4))
        self.bridge = HttpBridge(self.frontend, self.send)
        self.app = build_app(self.bridge, HttpSettings("m"))
        self.started: list[TokenizedRequest] = []
        self.finished: list[FinishReq] = []
        self.delivered: dict[bytes, list[GenerateOutput]] = {}  # each client's replies, in order
        self.ids = tokenizer.encode(TEXT, add_special_tokens=False)
        self._codec: Codec[ToTokenizer] = Codec(ToTokenizer)

    async def send(self, out: Outbox) -> None:
        for msg in out.to_scheduler:
            if isinstance(msg, TokenizedRequest):
                self.started.append(msg)
            elif isinstance(msg, FinishReq):
                self.finished.append(msg)
        for client_id, reply in out.replies:
            self.delivered.setdefault(client_id, []).append(reply)
            self.bridge.deliver(client_id, reply)

    async def step(self, rows: list[tuple[int, int, FinishReason | None]]) -> None:
        """One step's rows (rid, token, finish reason); a rid may come more than once (a verify row)."""
        batch = TokenBatch(
            rids=[r for r, _, _ in rows],
            token_ids=[t for _, t, _ in rows],
            logprobs=[-0.25 - 0.5 * i for i in range(len(rows))],
            finished=[f for _, _, f in rows],
            cached_tokens=[0] * len(rows),
        )
        await self.send(self.frontend.on_scheduler_msg(self._codec.decode(self._codec.encode(batch))))
        await asyncio.sleep(0)  # let the streams' writers run between steps, as the sockets would

    async def error(self, rid: int, message: str) -> None:
        await self.send(self.frontend.on_scheduler_msg(RequestError(rid=rid, message=message)))
        await asyncio.sleep(0)

    async def run(self, path: str, body: dict[str, Any], drive: Callable[[Engine], Awaitable[None]]) -> bytes:
        """POST ``body`` to ``path`` while ``drive`` plays the scheduler; the whole body read."""

        async def post() -> bytes:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                reply = await c.post(path, json=body)
                assert reply.status_code == 200, reply.text
                assert reply.headers["content-type"].startswith("text/event-stream")
                return reply.content

        async def scheduler() -> None:
            while not self.started:
                await asyncio.sleep(0)
            await drive(self)

        content, _ = await asyncio.gather(post(), scheduler())
        return content


def events(content: bytes) -> list[Any]:
    """The stream's events: each ``data:`` line's JSON, "[DONE]" as itself."""
    assert content.endswith(b"\n\n"), content[-40:]
    out = []
    for event in content[:-2].split(b"\n\n"):
        assert event.startswith(b"data: "), event
        data = event[len(b"data: ") :]
        out.append("[DONE]" if data == b"[DONE]" else msgspec.json.decode(data))
    return out


def one_by_one(shape: ResponseShape, replies: list[tuple[int, GenerateOutput]]) -> bytes:
    """The body as the replies' events written one reply at a time, then usage and [DONE] (what the
    stream wrote before it gathered a step's events into one write)."""
    usages: dict[int, Any] = {}
    body = b""
    for index, reply in replies:
        body += b"".join(shape.events(index, reply))
        if reply.finish_reason is FinishReason.ERROR:
            return body
        if reply.finish_reason is not None:
            usages[index] = reply.usage
    usage = shape.usage_event([usages[i] for i in sorted(usages)])
    return body + (usage or b"") + b"data: [DONE]\n\n"


def test_a_streamed_completion_is_the_openai_chunks_of_its_tokens(frontend_parts: tuple[Any, Any]) -> None:
    engine = Engine(frontend_parts)
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip

    async def drive(e: Engine) -> None:
        rid = e.started[0].rid
        for i in range(4):
            await e.step([(rid, e.ids[i], FinishReason.LENGTH if i == 3 else None)])

    content = asyncio.run(engine.run("/v1/completions", body, drive))
    got = events(content)
    head = {k: got[0][k] for k in ("id", "created")}
    assert head["id"].startswith("cmpl-") and isinstance(head["created"], int)
    tokenizer = frontend_parts[0]
    texts = [tokenizer.decode(engine.ids[: i + 1]) for i in range(4)]
    pieces = [texts[0]] + [texts[i][len(texts[i - 1]) :] for i in range(1, 4)]
    expected: list[Any] = [
        {"id": head["id"], "object": "text_completion", "created": head["created"], "model": "m",
         "choices": [{"index": 0, "logprobs": None, "finish_reason": "length" if i == 3 else None,
                      "text": piece}], "usage": None}
        for i, piece in enumerate(pieces)
    ]  # fmt: skip
    expected.append(
        {"id": head["id"], "object": "text_completion", "created": head["created"], "model": "m",
         "choices": [], "usage": {"prompt_tokens": len(engine.started[0].input_ids), "completion_tokens": 4,
                                  "total_tokens": len(engine.started[0].input_ids) + 4,
                                  "prompt_tokens_details": {"cached_tokens": 0}}}
    )  # fmt: skip
    assert got == [*expected, "[DONE]"]
    # the bytes too: the encoder's compact JSON, one event a chunk
    assert content == b"".join(b"data: " + msgspec.json.encode(e) + b"\n\n" for e in expected) + (
        b"data: [DONE]\n\n"
    )
    assert len(engine.frontend.requests) == 0


@pytest.mark.parametrize("chat", [False, True])
def test_choices_tokens_of_one_step_are_the_bytes_of_their_replies_one_by_one(
    frontend_parts: tuple[Any, Any], chat: bool
) -> None:
    """n = 3 choices with logprobs; some steps carry two tokens of one choice (a verify row's) and
    every choice's token: one write a step, the same bytes as each reply's events in turn."""
    engine = Engine(frontend_parts)
    body: dict[str, Any] = {"model": "m", "max_tokens": 6, "stream": True, "n": 3,
                            "stream_options": {"include_usage": True}}  # fmt: skip
    if chat:
        body.update(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=0)
    else:
        body.update(prompt="hi", logprobs=1, echo=False)
    path = "/v1/chat/completions" if chat else "/v1/completions"

    async def drive(e: Engine) -> None:
        rid = e.started[0].rid
        sent = [0, 0, 0]

        def row(choice: int) -> tuple[int, int, FinishReason | None]:
            sent[choice] += 1
            last = sent[choice] == 6
            return rid + choice, e.ids[sent[choice] + choice], FinishReason.LENGTH if last else None

        await e.step([row(0), row(1), row(2)])
        await e.step([row(0), row(0), row(1)])  # choice 0 twice, choice 2 none
        await e.step([row(2), row(2), row(2), row(1)])
        while any(n < 6 for n in sent):
            await e.step([row(c) for c in range(3) if sent[c] < 6])

    content = asyncio.run(engine.run(path, body, drive))
    got = events(content)
    assert got[-1] == "[DONE]" and got[-2]["choices"] == [] and got[-2]["usage"]["completion_tokens"] == 18
    chunks = got[:-2]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1, 2}
    finals = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"] is not None]
    assert sorted(f["index"] for f in finals) == [0, 1, 2] and {f["finish_reason"] for f in finals} == {
        "length"
    }
    for chunk in chunks:
        choice = chunk["choices"][0]
        assert chunk["object"] == ("chat.completion.chunk" if chat else "text_completion")
        assert set(choice) == {"index", "logprobs", "finish_reason", "delta" if chat else "text"}
        if chat and choice["delta"].get("role") == "assistant":
            continue  # the role chunk: no token, no logprobs
        logprobs = choice["logprobs"]
        assert logprobs is not None, chunk
        if chat:
            assert all(set(t) >= {"token", "logprob", "bytes", "top_logprobs"} for t in logprobs["content"])
        else:
            assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    # The bytes: each delivered reply's events in delivery order, written one by one.
    (client_id,) = engine.delivered
    replies = [(r.index, r) for r in engine.delivered[client_id]]
    shape = ResponseShape(id=got[0]["id"], model="m", created=got[0]["created"], chat=chat, logprobs=True,
                          include_usage=True, texts=TokenTexts(engine.frontend.tokenizer),
                          choices_per_prompt=3, echo={"service_tier": "default"} if chat else {})  # fmt: skip
    assert content == one_by_one(shape, replies)


def test_an_error_ends_the_stream_with_its_event_and_aborts_the_other_choices(
    frontend_parts: tuple[Any, Any],
) -> None:
    engine = Engine(frontend_parts)
    body = {"model": "m", "prompt": "hi", "max_tokens": 8, "stream": True, "n": 2}

    async def drive(e: Engine) -> None:
        rid = e.started[0].rid
        await e.step([(rid, e.ids[0], None), (rid + 1, e.ids[1], None)])
        await e.error(rid + 1, "the worker fell over")
        await e.step([(rid, e.ids[2], None)])  # choice 0 runs on until its abort reaches the scheduler

    content = asyncio.run(engine.run("/v1/completions", body, drive))
    got = events(content)
    assert "[DONE]" not in got
    assert [c["choices"][0]["text"] for c in got[:2]] == [
        engine.frontend.tokenizer.decode(engine.ids[:1]),
        engine.frontend.tokenizer.decode(engine.ids[1:2]),
    ]
    assert "the worker fell over" in got[2]["error"]["message"] and len(got) == 3
    assert [f.rid for f in engine.finished] == [engine.started[0].rid]  # choice 0 aborted
    assert len(engine.frontend.requests) == 0


def test_a_fault_making_one_streams_events_is_that_streams_alone(
    frontend_parts: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The events are made as the process loop delivers a step's replies: a bug there must neither
    reach the loop (the other streams' replies of that step would be lost) nor pass unseen (the
    handler raises it, as it did when it made the events itself)."""
    engine = Engine(frontend_parts)
    real_events = ResponseShape.events

    def events_with_a_bug(shape: ResponseShape, index: int, reply: GenerateOutput) -> list[bytes]:
        if shape.include_usage:  # the first stream's shape only
            raise RuntimeError("a bug")
        return real_events(shape, index, reply)

    monkeypatch.setattr(ResponseShape, "events", events_with_a_bug)
    buggy = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    fine = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True}

    async def scenario() -> tuple[BaseException | bytes, BaseException | bytes]:
        transport = httpx.ASGITransport(app=engine.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:

            async def drive() -> None:
                while len(engine.started) < 2:
                    await asyncio.sleep(0)
                rids = [r.rid for r in engine.started]
                for i in range(3):
                    reason = FinishReason.LENGTH if i == 2 else None
                    await engine.step([(rid, engine.ids[i], reason) for rid in rids])

            async def post(body: dict[str, Any]) -> bytes:
                return (await c.post("/v1/completions", json=body)).content

            first = asyncio.create_task(post(buggy))
            while not engine.started:
                await asyncio.sleep(0)
            second = asyncio.create_task(post(fine))
            results = await asyncio.gather(first, second, drive(), return_exceptions=True)
            return results[0], results[1]

    failed, content = asyncio.run(scenario())
    assert isinstance(failed, RuntimeError) and "a bug" in str(failed)
    assert isinstance(content, bytes), content
    got = events(content)
    assert got[-1] == "[DONE]" and len(got) == 4  # the other stream: its 3 tokens, then [DONE]
    assert len(engine.frontend.requests) == 0
