"""The gpu_worker process: ForwardBatch in, ForwardResult out."""

from __future__ import annotations

import logging
import os
import time

import msgspec
import zmq

from gpu_worker.config import WorkerConfig
from gpu_worker.inbox import Inbox
from gpu_worker.model_runner import ModelRunner
from gpu_worker.tensor_parallel import gather_strings, init_group
from protocol.messages import ForwardBatch, ForwardResult, ToWorker, WorkerReady
from protocol.step_trace import StepTrace, run_delay_s
from protocol.transport import Codec, Endpoints, freeze_startup_heap, make_socket

logger = logging.getLogger(__name__)


def run_worker(config: WorkerConfig, endpoints: Endpoints) -> None:
    """Load the model, announce WorkerReady, then execute batches until the process is stopped.

    A malformed frame is logged and dropped (there is no step to answer); a batch
    whose forward fails is answered with ``ForwardResult.error`` and serving goes on.
    """
    if config.cpu_ids:  # before torch sizes its thread pool: its threads follow the affinity
        os.sched_setaffinity(0, config.cpu_ids)
    if config.tp_size > 1:  # the ranks meet before loading: they agree on the KV pool
        init_group(config.tp_rank, config.tp_size, config.dist_init_addr)
    runner = ModelRunner(config)
    ctx = zmq.Context()
    inbox = Inbox(ctx, endpoints, config.tp_rank, config.node_host)
    rank_endpoints = gather_strings(inbox.endpoint) if config.tp_size > 1 else []
    # Every rank runs every batch; rank 0 alone answers (the others drew the same tokens).
    outbox = make_socket(ctx, zmq.PUSH, endpoints.from_worker, bind=False) if config.tp_rank == 0 else None
    launcher = make_socket(ctx, zmq.PUSH, endpoints.to_launcher, bind=False)
    codec: Codec[ToWorker] = Codec(ToWorker)
    freeze_startup_heap()
    launcher.send(codec.encode(_ready(runner, config, rank_endpoints)))
    busy_s = 0.0  # seconds spent on batches, from a frame's arrival to its reply
    trace = StepTrace.open(f"worker{config.tp_rank}")
    while True:
        if not inbox.wait():
            logger.info("rank %d: the head node's scheduler has gone; stopping", config.tp_rank)
            return
        frame = inbox.sock.recv(copy=False)
        received = time.monotonic()
        try:
            batch = codec.decode(frame.buffer)
        except Exception as exc:  # any fault of one frame (Codec raises msgspec's errors) drops it alone
            logger.error("dropped a malformed frame (%d bytes): %r", len(frame.buffer), exc)
            continue
        before = (time.thread_time(), time.process_time(), run_delay_s() or 0.0) if trace else (0.0, 0.0, 0.0)
        result = _execute(runner, batch)
        now = time.monotonic()
        busy_s += now - received
        if outbox is not None:
            outbox.send(codec.encode(msgspec.structs.replace(result, busy_s=busy_s, clock_s=now)))
        if trace is not None:
            _trace_step(trace, batch, result, received, now, before)


def _execute(runner: ModelRunner, batch: ForwardBatch) -> ForwardResult:
    """The batch's result; a failed forward fails its requests, not the worker."""
    started = time.perf_counter()
    try:
        return runner.execute(batch)
    except Exception as exc:
        logger.exception("step %d failed", batch.step)
        return ForwardResult(
            step=batch.step,
            token_ids=[],
            logprobs=[],
            forward_s=time.perf_counter() - started,
            error=f"{type(exc).__name__}: {exc}",
        )


def _trace_step(
    trace: StepTrace,
    batch: ForwardBatch,
    result: ForwardResult,
    received: float,
    replied: float,
    before: tuple[float, float, float],
) -> None:
    """One step's line: its frame's arrival, its reply's start and end (monotonic), rows and tokens, the
    forward's seconds, this thread's and the whole process's CPU from the decoded frame to the reply
    sent, this thread's CPU and wait for a core before that (cumulative) and during it, the thread
    count after it."""
    import torch

    sent = time.monotonic()
    trace.write(
        "step",
        step=batch.step,
        recv=received,
        reply=replied,
        sent=sent,
        forward_s=result.forward_s,
        rows=len(batch.req_pool_idx),
        tokens=len(batch.input_ids),
        decode_rows=sum(1 for n in batch.extend_lens if n == 1),
        cpu_s=time.thread_time() - before[0],
        proc_cpu_s=time.process_time() - before[1],
        delay_before_s=before[2],
        cpu_before_s=before[0],
        delay_s=(run_delay_s() or 0.0) - before[2],
        threads=torch.get_num_threads(),
    )


def _ready(runner: ModelRunner, config: WorkerConfig, rank_endpoints: list[str]) -> WorkerReady:
    dtype = str(runner.dtype).removeprefix("torch.")
    return WorkerReady(
        pid=os.getpid(),
        num_pages=runner.num_pages,
        page_size=config.page_size,
        context_len=runner.context_len,
        device=str(runner.device),
        dtype=dtype,
        replica=config.replica,
        tp_rank=config.tp_rank,
        rank_endpoints=rank_endpoints if config.tp_rank == 0 else [],
        state_checkpoints=runner.state_checkpoints,
    )
