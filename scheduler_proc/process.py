"""The scheduler process: a thin ZMQ loop around the pure ``Scheduler`` core."""

from __future__ import annotations

import logging
import os
import time
from typing import cast

import msgspec
import zmq

from protocol.messages import (
    EngineStats,
    FinishReason,
    FinishReq,
    FlushPrefixCache,
    ForwardResult,
    FromWorker,
    Ready,
    RequestError,
    TokenizedRequest,
    ToScheduler,
)
from protocol.profiling import cprofiled
from protocol.step_trace import StepTrace
from protocol.transport import Codec, Endpoints, freeze_startup_heap, make_socket, replica_name
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.scheduler import Scheduler
from scheduler_proc.stats import SchedulerStats

STATS_INTERVAL_S = 0.5  # EngineStats at most this often while busy (for /metrics)
# getsockopt's option and flag as plain ints: pyzmq's are enums, whose ``&`` runs in Python.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


class SchedulerProcess:
    """Owns the sockets; everything else is the core's business.

    Binds PULL on ``to_scheduler`` and ``from_worker``; connects PUSH to
    ``to_tokenizer``, ``to_worker`` (each tensor-parallel rank's) and ``to_launcher``.
    """

    def __init__(self, config: SchedulerConfig, endpoints: Endpoints, ctx: zmq.Context) -> None:
        self.log = logging.getLogger("rivulet.scheduler")
        self.scheduler = Scheduler(config)
        self.stats = SchedulerStats(config.decode_log_interval, self.log)
        self._init_sockets(endpoints, ctx)
        self._sent_stats: EngineStats | None = None
        self._sent_stats_s = 0.0
        self.trace = StepTrace.open(replica_name("scheduler", config.replica))

    def _init_sockets(self, endpoints: Endpoints, ctx: zmq.Context) -> None:
        self.from_tokenizer = make_socket(ctx, zmq.PULL, endpoints.to_scheduler, bind=True)
        self.from_worker = make_socket(ctx, zmq.PULL, endpoints.from_worker, bind=True)
        self.to_tokenizer = make_socket(ctx, zmq.PUSH, endpoints.to_tokenizer, bind=False)
        # One per tensor-parallel rank (--tp-size, on any node): every rank runs every batch.
        ranks = self.scheduler.config.worker_endpoints or (endpoints.to_worker,)
        self.to_workers = [make_socket(ctx, zmq.PUSH, endpoint, bind=False) for endpoint in ranks]
        self.to_launcher = make_socket(ctx, zmq.PUSH, endpoints.to_launcher, bind=False)
        self.encoder = msgspec.msgpack.Encoder()  # every outgoing message, whatever its channel
        self.tokenizer_codec: Codec[ToScheduler] = Codec(ToScheduler)
        self.worker_codec: Codec[FromWorker] = Codec(FromWorker)
        self.poller = zmq.Poller()
        self.poller.register(self.from_tokenizer, zmq.POLLIN)
        self.poller.register(self.from_worker, zmq.POLLIN)

    def announce(self) -> None:
        """The first EngineStats to the tokenizer (the context served, before any client can ask),
        then Ready to the launcher."""
        self._publish_stats()
        name = replica_name("scheduler", self.scheduler.config.replica)
        self.to_launcher.send(self.encoder.encode(Ready(proc=name, pid=os.getpid())))

    def run_forever(self) -> None:
        """Block only when idle (nothing runnable, or waiting on the worker); one batch per turn."""
        idle = True
        while True:
            self._publish_stats()
            for sock in dict(self.poller.poll(None if idle else 0)):
                self._drain(sock)
            batch = self.scheduler.schedule()
            if batch is not None:
                frame = self.encoder.encode(batch)
                for sock in self.to_workers:
                    sock.send(frame)
                self.stats.on_batch(self.scheduler)
                if self.trace is not None:
                    self._trace_batch(self.trace)
            for out in self.scheduler.take_outputs():
                self.to_tokenizer.send(self.encoder.encode(out))
            idle = batch is None
            if idle and not self.scheduler.has_work:
                self.stats.on_idle(self.scheduler)

    def _trace_batch(self, trace: StepTrace) -> None:
        info = self.scheduler.last_batch
        assert info is not None, "a batch was just scheduled"
        trace.write(
            "send",
            t=time.monotonic(),
            step=info.step,
            prefill_rows=info.num_prefill_rows,
            prefill_tokens=info.num_prefill_tokens,
            decode_rows=info.num_decode_rows,
            waiting=len(self.scheduler.waiting),
        )

    def _publish_stats(self) -> None:
        """Throttled while busy; sent on change before blocking idle, so no timer wakes the engine.
        Built only when it may be sent (the loop turns two or more times a step)."""
        sched, now = self.scheduler, time.monotonic()
        if sched.has_work and now - self._sent_stats_s < STATS_INTERVAL_S:
            return
        drafts = sched.draft_totals
        stats = EngineStats(
            num_running=len(sched.running) + (sched.chunked_req is not None),
            num_waiting=len(sched.waiting),
            num_pages=sched.kv.pages.num_pages,
            free_pages=sched.kv.pages.num_free,
            evictable_pages=sched.kv.evictable_pages,
            worker_busy_s=self.stats.worker_busy_s,
            worker_clock_s=self.stats.worker_clock_s,
            prefill_tokens=sched.num_prefill_tokens,
            draft_tokens=drafts.drafted,
            accepted_draft_tokens=drafts.accepted,
            verify_rows=drafts.verify_rows,
            replica=sched.config.replica,
            context_len=sched.config.context_len,
        )
        if stats != self._sent_stats:
            self.to_tokenizer.send(self.encoder.encode(stats))
            self._sent_stats, self._sent_stats_s = stats, now

    def _drain(self, sock: zmq.Socket) -> None:
        """Every frame waiting on ``sock``. ``EVENTS`` says whether one waits: ending on a recv's
        EAGAIN instead raised a ZMQError (built in Python) every drain, every step."""
        while cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if sock is self.from_worker:
                self._on_worker_frame(frame)
            else:
                self._on_tokenizer_frame(frame)

    def _on_tokenizer_frame(self, frame: bytes) -> None:
        try:
            msg = self.tokenizer_codec.decode(frame)
        except msgspec.DecodeError as exc:
            # No rid to answer to: the tokenizer only sends what it validated, so log and drop.
            self.log.error("dropped a malformed frame from the tokenizer (%d bytes): %s", len(frame), exc)
            return
        try:
            self._on_tokenizer_msg(msg)
        except Exception as exc:  # a fault on one request fails that request; the engine serves on
            self.log.exception("handling a %s failed", type(msg).__name__)
            if isinstance(msg, TokenizedRequest):
                self._fail_request(msg, f"internal error: {exc!r}")

    def _fail_request(self, msg: TokenizedRequest, error: str) -> None:
        """Error replies for every choice of ``msg``, then whatever of it the core holds is ended
        (its ABORT rows, if any, reach the tokenizer after the errors and are ignored there)."""
        for rid in range(msg.rid, msg.rid + max(msg.n, 1)):
            self.to_tokenizer.send(self.encoder.encode(RequestError(rid=rid, message=error)))
        try:
            for rid in range(msg.rid, msg.rid + max(msg.n, 1)):
                self.scheduler.abort(rid, FinishReason.ERROR)
        except Exception:
            self.log.exception("ending rid %d after its fault failed too", msg.rid)

    def _on_tokenizer_msg(self, msg: ToScheduler) -> None:
        match msg:
            case TokenizedRequest():
                if self.trace is not None:
                    self.trace.write("add", t=time.monotonic(), rid=msg.rid, prompt=len(msg.input_ids))
                error = self.scheduler.add(msg)
                if error is not None:
                    self.log.warning("rejected rid %d: %s", msg.rid, error.message)
                    self.to_tokenizer.send(self.encoder.encode(error))
            case FinishReq():
                self.scheduler.abort(msg.rid, msg.reason)
            case FlushPrefixCache():
                self.log.info("flushed the prefix cache: %d pages freed", self.scheduler.flush_cache())
            case _:
                raise TypeError(f"unexpected message on to_scheduler: {type(msg).__name__}")

    def _on_worker_frame(self, frame: bytes) -> None:
        try:
            msg = self.worker_codec.decode(frame)
        except msgspec.DecodeError as exc:
            # The batch it answered is lost with it: fail that batch's requests so no client waits forever.
            self.log.error("malformed frame from the worker (%d bytes): %s", len(frame), exc)
            self.scheduler.fail_in_flight(f"malformed worker reply: {exc}")
            return
        try:
            match msg:
                case ForwardResult():
                    if self.trace is not None:
                        self.trace.write("result", t=time.monotonic(), step=msg.step)
                    self.stats.on_worker_result(msg.busy_s, msg.clock_s)
                    self.scheduler.on_result(msg)
                case _:
                    raise TypeError(f"unexpected message on from_worker: {type(msg).__name__}")
        except Exception as exc:  # as for a reply that did not decode: the batches out fail, not the engine
            self.log.exception("handling the worker's reply failed")
            self.scheduler.fail_in_flight(f"internal error: {exc!r}")


def run_scheduler(config: SchedulerConfig, endpoints: Endpoints) -> None:
    """Entry point of the scheduler process: serve until the process is terminated."""
    ctx = zmq.Context()
    try:
        proc = SchedulerProcess(config, endpoints, ctx)
        freeze_startup_heap()
        proc.announce()
        with cprofiled(replica_name("scheduler", config.replica)):
            proc.run_forever()
    finally:
        ctx.destroy(linger=0)
