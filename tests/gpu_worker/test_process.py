"""run_worker in a spawned child over real ZMQ sockets (takes a few seconds: the child imports torch)."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import msgspec
import pytest
import zmq

from gpu_worker.config import WorkerConfig
from gpu_worker.process import run_worker
from protocol.embedding import Pooling
from protocol.messages import ForwardBatch, ForwardResult, WorkerReady
from protocol.transport import Codec, Endpoints, make_socket
from tests.gpu_worker.helpers import GREEDY, save_tiny_model

RECV_TIMEOUT_MS = 60_000


def recv(sock: zmq.Socket, decode_type: object) -> object:
    assert sock.poll(RECV_TIMEOUT_MS), "no reply from the worker in time"
    return msgspec.msgpack.decode(sock.recv(), type=decode_type)


def one_row(step: int, idx: int, ids: list[int], pages: list[int], logprobs: bool = True) -> ForwardBatch:
    return ForwardBatch(
        step=step,
        req_pool_idx=[idx],
        prefix_lens=[0],
        extend_lens=[len(ids)],
        input_ids=ids,
        page_starts=[0],
        page_counts=[len(pages)],
        pages=pages,
        sample=[True],
        sampler=[msgspec.structs.replace(GREEDY, logprobs=logprobs)],
    )


def test_worker_serves_batches_and_survives_bad_input(tmp_path: Path) -> None:
    save_tiny_model("llama", True, tmp_path / "model")
    config = WorkerConfig(
        model_path=str(tmp_path / "model"),
        dtype="float64",
        kv_cache_tokens=64,
        page_size=8,
        max_running_requests=4,
        num_threads=1,
    )
    endpoints = Endpoints.in_dir(str(tmp_path))
    ctx = zmq.Context()
    launcher = make_socket(ctx, zmq.PULL, endpoints.to_launcher, bind=True)
    results = make_socket(ctx, zmq.PULL, endpoints.from_worker, bind=True)
    to_worker = make_socket(ctx, zmq.PUSH, endpoints.to_worker, bind=False)
    codec: Codec[ForwardResult] = Codec(ForwardResult)
    child = multiprocessing.get_context("spawn").Process(target=run_worker, args=(config, endpoints))
    child.start()
    try:
        ready = recv(launcher, WorkerReady)
        assert isinstance(ready, WorkerReady)
        assert (ready.pid, ready.num_pages, ready.page_size) == (child.pid, 8, 8)
        # The pool's 64 tokens bound the model's 256: the worker serves 64.
        assert (ready.context_len, ready.device, ready.dtype) == (64, "cpu", "float64")

        to_worker.send(b"\xc1 not msgpack")
        to_worker.send(codec.encode(one_row(1, 0, [3, 4, 5], [9])))  # page 9 is outside the pool
        to_worker.send(codec.encode(one_row(2, 1, [3, 4, 5], [2])))
        failed = recv(results, ForwardResult)
        served = recv(results, ForwardResult)
        assert isinstance(failed, ForwardResult) and isinstance(served, ForwardResult)
        assert failed.step == 1 and failed.token_ids == [] and "pages" in (failed.error or "")
        assert served.step == 2 and served.error is None and len(served.token_ids) == 1
        assert 0 <= served.token_ids[0] < 500 and served.logprobs[0] < 0.0
        to_worker.send(codec.encode(one_row(3, 2, [3, 4, 5], [3], logprobs=False)))
        unasked = recv(results, ForwardResult)
        assert isinstance(unasked, ForwardResult) and unasked.token_ids == served.token_ids
        assert unasked.logprobs == [], "no row asked for logprobs: the worker skips them"
        # A pooling rule broken (two pool entries for one row): refused before the forward, then served.
        to_worker.send(
            codec.encode(msgspec.structs.replace(one_row(4, 3, [3, 4], [4]), pool=[None, Pooling.LAST]))
        )
        to_worker.send(codec.encode(msgspec.structs.replace(one_row(5, 3, [3, 4], [4]), pool=[Pooling.LAST])))
        refused, pooled = recv(results, ForwardResult), recv(results, ForwardResult)
        assert isinstance(refused, ForwardResult) and isinstance(pooled, ForwardResult)
        assert refused.step == 4 and "BatchError: batch 4: pool has 2 entries for 1 rows" in (
            refused.error or ""
        )
        assert pooled.step == 5 and pooled.error is None and len(pooled.pooled) == 1
        # The busy counter runs on the worker's clock: it grows with each batch, never past the clock.
        assert 0 < failed.busy_s < served.busy_s and failed.clock_s < served.clock_s
        assert served.busy_s - failed.busy_s <= served.clock_s - failed.clock_s
    finally:
        if child.pid is not None and child.is_alive():
            os.kill(child.pid, signal.SIGTERM)
        child.join(timeout=10)
        if child.is_alive() and child.pid is not None:
            os.kill(child.pid, signal.SIGKILL)
            child.join()
        ctx.destroy(linger=0)
    assert not child.is_alive()


@pytest.fixture(autouse=True)
def _no_leaked_children() -> object:
    yield
    assert not multiprocessing.active_children(), "a test left a child process running"
