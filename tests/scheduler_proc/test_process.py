"""run_scheduler in a real child process; the test plays tokenizer, worker and launcher over ZMQ."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from protocol.messages import (
    EngineStats,
    FinishReason,
    FlushPrefixCache,
    ForwardBatch,
    Ready,
    RequestError,
    TokenBatch,
    ToLauncher,
    ToTokenizer,
    ToWorker,
)
from protocol.transport import Codec, Endpoints, make_socket
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.process import run_scheduler
from tests.scheduler_proc.harness import FakeWorker, reference_output, tokenized

CONFIG = SchedulerConfig(num_pages=64, context_len=128, page_size=4, chunked_prefill_size=8)


def recv(sock: zmq.Socket, codec: Codec[Any], stats: list[EngineStats] | None = None) -> Any:
    """The next message, skipping EngineStats (the scheduler's periodic load report) into ``stats``."""
    while True:
        assert sock.poll(20_000), "nothing arrived in time"
        msg = codec.decode(sock.recv())
        if not isinstance(msg, EngineStats):
            return msg
        if stats is not None:
            stats.append(msg)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.fixture
def scheduler_child() -> Iterator[tuple[multiprocessing.process.BaseProcess, dict[str, zmq.Socket]]]:
    run_dir = tempfile.mkdtemp(prefix="riv-sched-")
    endpoints = Endpoints.in_dir(run_dir)
    ctx = zmq.Context()
    socks = {
        "to_tokenizer": make_socket(ctx, zmq.PULL, endpoints.to_tokenizer, bind=True),
        "to_worker": make_socket(ctx, zmq.PULL, endpoints.to_worker, bind=True),
        "to_launcher": make_socket(ctx, zmq.PULL, endpoints.to_launcher, bind=True),
        "to_scheduler": make_socket(ctx, zmq.PUSH, endpoints.to_scheduler, bind=False),
        "from_worker": make_socket(ctx, zmq.PUSH, endpoints.from_worker, bind=False),
    }
    child = multiprocessing.get_context("spawn").Process(target=run_scheduler, args=(CONFIG, endpoints))
    child.start()
    try:
        yield child, socks
    finally:
        if child.pid is not None and child.is_alive():
            os.kill(child.pid, signal.SIGTERM)
        child.join(5)
        if child.pid is not None and child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
            child.join(5)
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


def test_scheduler_process_serves_over_zmq(scheduler_child: Any) -> None:
    child, socks = scheduler_child
    ready = recv(socks["to_launcher"], Codec(ToLauncher))
    assert ready == Ready(proc="scheduler", pid=child.pid)
    codec: Codec[ToTokenizer] = Codec(ToTokenizer)
    reports: list[EngineStats] = []
    assert socks["to_tokenizer"].poll(20_000), "no EngineStats at start"
    first = codec.decode(socks["to_tokenizer"].recv())  # tells the tokenizer the scheduler is up
    # ... and the context it serves (WorkerReady's, in its config)
    assert first == EngineStats(num_running=0, num_waiting=0, num_pages=64, free_pages=64, context_len=128)
    socks["to_scheduler"].send(b"\xc1 not msgpack")  # survived: logged and dropped
    socks["to_scheduler"].send(codec.encode(tokenized(1, [7] * 200, 1)))  # beyond context_len
    prompt = list(range(10, 30))
    socks["to_scheduler"].send(codec.encode(tokenized(2, prompt, 6)))

    rejected = recv(socks["to_tokenizer"], codec, reports)
    assert isinstance(rejected, RequestError) and rejected.rid == 1 and "context length" in rejected.message
    worker = FakeWorker(CONFIG)
    worker_codec: Codec[ToWorker] = Codec(ToWorker)
    tokens: list[int] = []
    finished: FinishReason | None = None
    while finished is None:
        batch = recv(socks["to_worker"], worker_codec)
        assert isinstance(batch, ForwardBatch)
        socks["from_worker"].send(codec.encode(worker.run(batch)))
        if any(batch.sample):
            out = recv(socks["to_tokenizer"], codec, reports)
            assert isinstance(out, TokenBatch) and out.rids == [2]
            tokens += out.token_ids
            finished = out.finished[0]
    assert (tokens, finished) == reference_output(prompt, 6, [], CONFIG.context_len)

    # A reply the scheduler cannot decode fails that batch's requests instead of hanging them.
    socks["to_scheduler"].send(codec.encode(tokenized(3, prompt, 6)))
    assert isinstance(recv(socks["to_worker"], worker_codec), ForwardBatch)
    socks["from_worker"].send(b"\x93garbage")
    failed = recv(socks["to_tokenizer"], codec, reports)
    assert isinstance(failed, RequestError) and failed.rid == 3 and "malformed" in failed.message

    # Idle now: the loop must block on its sockets, not spin.
    before = cpu_seconds(child.pid)
    time.sleep(1.0)
    assert cpu_seconds(child.pid) - before < 0.2, "an idle scheduler burns CPU"
    assert child.is_alive()

    # Request 2's prompt stayed cached; FlushPrefixCache frees it, and the idle report says so.
    while socks["to_tokenizer"].poll(0):
        assert isinstance(msg := codec.decode(socks["to_tokenizer"].recv()), EngineStats)
        reports.append(msg)
    last = reports[-1]
    assert last.evictable_pages > 0 and last.free_pages + last.evictable_pages == CONFIG.num_pages
    socks["to_scheduler"].send(codec.encode(FlushPrefixCache()))
    stats = None
    while stats is None or stats.free_pages != CONFIG.num_pages:
        assert socks["to_tokenizer"].poll(20_000), "no EngineStats after FlushPrefixCache"
        msg = codec.decode(socks["to_tokenizer"].recv())
        stats = msg if isinstance(msg, EngineStats) else stats
    assert stats.evictable_pages == 0


def test_a_fault_handling_one_request_fails_it_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug the core hits on one message: that request's choices get errors, the loop serves on."""
    from scheduler_proc.process import SchedulerProcess

    run_dir = tempfile.mkdtemp(prefix="riv-sched-")
    endpoints = Endpoints.in_dir(run_dir)
    ctx = zmq.Context()
    try:
        to_tokenizer = make_socket(ctx, zmq.PULL, endpoints.to_tokenizer, bind=True)
        proc = SchedulerProcess(CONFIG, endpoints, ctx)
        codec: Codec[ToTokenizer] = Codec(ToTokenizer)
        real_add = proc.scheduler.add

        def add_with_a_bug(msg: Any) -> RequestError | None:
            if msg.rid == 1:
                raise RuntimeError("a bug")
            return real_add(msg)

        monkeypatch.setattr(proc.scheduler, "add", add_with_a_bug)
        proc._on_tokenizer_frame(codec.encode(tokenized(1, [5, 6, 7], 4, n=2)))
        errors = [recv(to_tokenizer, codec) for _ in range(2)]
        assert [(e.rid, "a bug" in e.message) for e in errors] == [(1, True), (2, True)]
        proc._on_tokenizer_frame(codec.encode(tokenized(3, [5, 6, 7], 4)))
        assert proc.scheduler.schedule() is not None  # the next request runs
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)
