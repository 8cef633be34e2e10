"""The tokenizer process over real ZMQ sockets, with the test playing the scheduler and a real Client."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import pytest
import zmq

from client import Client, EngineError
from protocol.messages import (
    FinishReason,
    FinishReq,
    GenerateOutput,
    Ready,
    RequestError,
    TokenBatch,
    TokenizedRequest,
    ToLauncher,
    ToScheduler,
)
from protocol.transport import Codec, Endpoints, make_socket
from tokenizer_proc.config import TokenizerConfig
from tokenizer_proc.process import run_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

READY_TIMEOUT_S = 120.0  # a cold transformers import on a busy 2-core machine


@dataclass
class FakeScheduler:
    """The scheduler's two sockets, driven by the test."""

    pull: zmq.Socket
    push: zmq.Socket
    codec: Codec[Any]

    def recv(self, timeout_s: float = 10.0) -> Any:
        assert self.pull.poll(int(timeout_s * 1000)), "nothing reached the scheduler"
        return self.codec.decode(self.pull.recv())

    def send_tokens(self, rid: int, ids: list[int], last: FinishReason | None, cached: int = 0) -> None:
        for i, token in enumerate(ids):
            finished = last if i == len(ids) - 1 else None
            batch = TokenBatch(
                rids=[rid], token_ids=[token], logprobs=[-1.0], finished=[finished], cached_tokens=[cached]
            )
            self.push.send(self.codec.encode(batch))


@dataclass
class Engine:
    endpoints: Endpoints
    proc: multiprocessing.process.BaseProcess
    scheduler: FakeScheduler


@contextlib.contextmanager
def _start(model_dir: Path) -> Iterator[Engine]:
    run_dir = tempfile.mkdtemp(prefix="rv-tok-")  # short: ipc paths are limited to ~100 chars
    endpoints = Endpoints.in_dir(run_dir)
    ctx = zmq.Context()
    launcher = make_socket(ctx, zmq.PULL, endpoints.to_launcher, bind=True)
    scheduler = FakeScheduler(
        pull=make_socket(ctx, zmq.PULL, endpoints.to_scheduler, bind=True),
        push=make_socket(ctx, zmq.PUSH, endpoints.to_tokenizer, bind=False),
        codec=Codec(ToScheduler),
    )
    config = TokenizerConfig(model_path=str(model_dir), seed=0)
    proc = multiprocessing.get_context("spawn").Process(target=run_tokenizer, args=(config, endpoints))
    proc.start()
    try:
        assert launcher.poll(int(READY_TIMEOUT_S * 1000)), "the tokenizer process never sent Ready"
        ready = Codec[ToLauncher](ToLauncher).decode(launcher.recv())
        assert ready == Ready(proc="tokenizer", pid=proc.pid or -1)
        yield Engine(endpoints=endpoints, proc=proc, scheduler=scheduler)
    finally:
        if proc.pid is not None and proc.exitcode is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    with _start(model_dir) as started:
        yield started


@pytest.fixture
def client(engine: Engine) -> Iterator[Client]:
    with Client(engine.endpoints.client, timeout_s=10.0) as c:
        yield c


def test_streaming_round_trip(engine: Engine, client: Client, tokenizer: PreTrainedTokenizerBase) -> None:
    stream = client.generate("The capital of France is", stream=True, max_new_tokens=20, logprobs=True)
    req = engine.scheduler.recv()
    assert isinstance(req, TokenizedRequest)
    assert req.input_ids == tokenizer.encode("The capital of France is") and req.max_new_tokens == 20
    ids = tokenizer.encode(" Paris 🗼, of course.") + [2]
    engine.scheduler.send_tokens(req.rid, ids, FinishReason.STOP, cached=2)
    deltas = list(stream)
    assert "".join(d.text for d in deltas) == " Paris 🗼, of course."
    assert [t for d in deltas for t in d.token_ids] == ids
    final = deltas[-1]
    assert final.finish_reason is FinishReason.STOP and final.logprobs == [-1.0]
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_tokens) == (
        len(req.input_ids),
        len(ids),
        2,
    )


def test_non_streaming_chat_round_trip(
    engine: Engine, client: Client, tokenizer: PreTrainedTokenizerBase
) -> None:
    ids = tokenizer.encode("Bonjour à tous")
    messages = [{"role": "user", "content": "Say hi in French"}]
    stream = client.generate(messages=messages, stream=True, max_new_tokens=5)
    req = engine.scheduler.recv()
    engine.scheduler.send_tokens(req.rid, ids, FinishReason.LENGTH)
    assert "".join(d.text for d in stream) == "Bonjour à tous"
    assert str(tokenizer.decode(req.input_ids)).endswith("<|im_start|>assistant\n")

    # Non-streaming generate() blocks until the end, so the scheduler answers from a thread.
    out = _generate_with_answer(engine, client, tokenizer, " Paris", FinishReason.LENGTH)
    assert (out.text, out.finish_reason, (out.usage.completion_tokens if out.usage else None)) == (
        " Paris",
        FinishReason.LENGTH,
        1,
    )


def _generate_with_answer(
    engine: Engine, client: Client, tokenizer: PreTrainedTokenizerBase, answer: str, finish: FinishReason
) -> GenerateOutput:
    """A non-streaming generate; the scheduler answers from a thread while the client blocks."""
    import threading

    def scheduler() -> None:
        req = engine.scheduler.recv()
        engine.scheduler.send_tokens(req.rid, tokenizer.encode(answer), finish)

    thread = threading.Thread(target=scheduler)
    thread.start()
    try:
        out = client.generate("Capital of France?", max_new_tokens=4)
    finally:
        thread.join(10)
    assert isinstance(out, GenerateOutput)
    return out


def test_garbage_and_unknown_fields_get_errors(
    engine: Engine, client: Client, tokenizer: PreTrainedTokenizerBase
) -> None:
    raw: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(engine.endpoints.client)
    try:
        codec: Codec[GenerateOutput] = Codec(GenerateOutput)
        raw.send(b"\xc1 not msgpack")
        assert raw.poll(10_000)
        reply = codec.decode(raw.recv())
        assert (reply.rid, reply.finish_reason) == ("", FinishReason.ERROR) and "malformed" in (
            reply.error or ""
        )
        raw.send(msgspec.msgpack.encode({"type": "generate", "rid": "u1", "prompt": "x", "max_tokens": 3}))
        assert raw.poll(10_000)
        reply = codec.decode(raw.recv())
        assert (reply.rid, reply.finish_reason) == ("u1", FinishReason.ERROR) and "max_tokens" in (
            reply.error or ""
        )
    finally:
        raw.close()
    out = _generate_with_answer(engine, client, tokenizer, " still here", FinishReason.STOP)
    assert out.text == " still here"


def test_invalid_request_raises_engine_error(client: Client) -> None:
    with pytest.raises(EngineError, match="sampling.top_p"):
        client.generate("hi", top_p=0.0)


def test_abort(engine: Engine, client: Client, tokenizer: PreTrainedTokenizerBase) -> None:
    stream = client.generate("Count to ten", stream=True, rid="ab1")
    req = engine.scheduler.recv()
    engine.scheduler.send_tokens(req.rid, tokenizer.encode(" one"), None)
    first = next(stream)
    assert first.text == " one"
    client.abort("ab1")
    assert engine.scheduler.recv() == FinishReq(rid=req.rid, reason=FinishReason.ABORT)
    engine.scheduler.send_tokens(req.rid, tokenizer.encode(" two"), None)  # late: must be ignored
    rest = list(stream)
    assert [d.finish_reason for d in rest] == [FinishReason.ABORT]
    assert rest[0].usage is not None and rest[0].usage.completion_tokens == 1


def test_stop_string(engine: Engine, client: Client, tokenizer: PreTrainedTokenizerBase) -> None:
    stream = client.generate("List", stream=True, stop=["\n\n"])
    req = engine.scheduler.recv()
    engine.scheduler.send_tokens(req.rid, tokenizer.encode("1. apples\n\n2. pears"), None)
    deltas = list(stream)
    assert "".join(d.text for d in deltas) == "1. apples"
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert engine.scheduler.recv() == FinishReq(rid=req.rid, reason=FinishReason.STOP)


def test_request_error(engine: Engine, client: Client) -> None:
    stream = client.generate("Too long for the KV pool", stream=True)
    req = engine.scheduler.recv()
    engine.scheduler.push.send(engine.scheduler.codec.encode(RequestError(rid=req.rid, message="no KV room")))
    with pytest.raises(EngineError, match="no KV room"):
        next(stream)


def test_sigterm_fails_waiting_clients(model_dir: Path) -> None:
    with _start(model_dir) as engine:
        with Client(engine.endpoints.client, timeout_s=30.0) as client:
            stream = client.generate("Hello", stream=True)
            assert isinstance(engine.scheduler.recv(), TokenizedRequest)
            assert engine.proc.pid is not None
            os.kill(engine.proc.pid, signal.SIGTERM)
            with pytest.raises(EngineError, match="shutting down"):
                next(stream)
            engine.proc.join(15)  # the bound: it must have exited by then
            assert engine.proc.exitcode == 0
