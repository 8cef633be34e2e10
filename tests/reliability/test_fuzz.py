"""Fuzz the client socket of a running engine: no input from a client, of any shape, ends a process.

FUZZ_BATCHES x BATCH_SIZE messages (random msgpack values, raw bytes in 1-3 frames, valid requests
with one field replaced by a random value of any type, invalid UTF-8 strings included, and valid
requests with a small max_new_tokens), sent over a few connections a batch at a time. Every rid the
tokenizer can read gets exactly one final reply per message that carried it (and no choice two);
no process is restarted; the engine goes idle with its KV free and answers a normal request.

A request that still runs LONG_REQUEST_S after its batch was sent (a mutated max_new_tokens: the
ZMQ path lowers it to the room in the context, here up to ~1000 tokens) is aborted, as a client
may abort it, so the run stays bounded; an abort that finds its request done is answered with an
error ("abort: no request ... in flight"), which the count leaves out.

The draws are derandomized (the same 10,000 messages on every run, so a failure in CI reproduces);
``RIVULET_FUZZ_RANDOM=1`` draws new ones, to hunt for what the fixed set misses.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator

import httpx
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client import Client
from protocol.messages import AbortRequest, ClientReply, FinishReason
from protocol.transport import Codec, make_socket
from tests.integration.engine import pid_alive
from tests.reliability.fuzz_frames import Fuzz, frames_of, messages
from tests.tokenizer_proc.http.server import HttpEngine, wait_idle_and_free
from tokenizer_proc.frontend import rid_of

# Hypothesis draws 25 messages per example at ~2 ms a message; 100 per example overran its buffer
# and it drew ~15x slower.
FUZZ_BATCHES = 400
BATCH_SIZE = 25  # 10,000 messages in all
IDLE_CHECK_EVERY = 20  # examples: then the engine must go idle with its KV free
CONNECTIONS = 4
LONG_REQUEST_S = 2.0
BATCH_TIMEOUT_S = 60.0
ABORT_MISSED = "abort: no request"  # the error an abort of a request already done gets

Key = tuple[int, str]  # (connection, rid)


class FuzzClient:
    """A few DEALER connections. Counts, per (connection, rid) the tokenizer can read, the messages
    sent and the final replies by choice, over the whole run: a final reply to a rid nobody sent,
    or more finals for one choice than messages with that rid, fails at once."""

    def __init__(self, engine: HttpEngine) -> None:
        self.ctx = zmq.Context()
        self.socks = [
            make_socket(self.ctx, zmq.DEALER, engine.engine.endpoint, bind=False) for _ in range(CONNECTIONS)
        ]
        self.poller = zmq.Poller()
        for sock in self.socks:
            self.poller.register(sock, zmq.POLLIN)
        self.http = httpx.Client(base_url=engine.base_url, timeout=10)
        self.codec: Codec[ClientReply] = Codec(ClientReply)
        self.sent: Counter[Key] = Counter()
        self.finals: Counter[tuple[int, str, int]] = Counter()  # (connection, rid, choice)
        self.aborted: set[Key] = set()
        self.last_message: dict[Key, Fuzz] = {}
        self.messages = self.replies = self.aborts = self.examples = 0

    def send(self, message: Fuzz) -> Key | None:
        """Send ``message`` on the next connection; its (connection, rid) when the rid is readable."""
        conn = self.messages % CONNECTIONS
        frames = frames_of(message, f"fz{self.messages}")
        self.messages += 1
        rid = rid_of(frames[0]) if len(frames) == 1 else ""
        key = (conn, rid) if rid else None
        if key is not None:
            self.sent[key] += 1
            self.last_message[key] = message
        self.socks[conn].send_multipart(frames)
        return key

    def abort(self, keys: Iterable[Key]) -> None:
        for conn, rid in keys:
            self.aborted.add((conn, rid))
            self.aborts += 1
            self.socks[conn].send(msgspec.msgpack.encode(AbortRequest(rid=rid)))

    def receive(self, timeout_ms: int) -> bool:
        """Take every reply that arrives within ``timeout_ms``; False when none did."""
        ready = dict(self.poller.poll(timeout_ms))
        for conn, sock in enumerate(self.socks):
            while sock in ready and sock.poll(0):
                reply = self.codec.decode(sock.recv())
                self.replies += 1
                if reply.finish_reason is not None and reply.rid:
                    self._final(conn, reply)
        return bool(ready)

    def _final(self, conn: int, reply: ClientReply) -> None:
        key, choice = (conn, reply.rid), (conn, reply.rid, reply.index)
        if reply.error is not None and reply.error.startswith(ABORT_MISSED):
            assert key in self.aborted, f"an abort nobody sent was answered: {reply}"
            return
        self.finals[choice] += 1
        assert self.finals[choice] <= self.sent[key], (
            f"{self.finals[choice]} final replies to {choice}, {self.sent[key]} messages sent with "
            f"that rid; the last: {self.last_message.get(key)}; this reply: {reply}"
        )

    def missing(self, keys: Iterable[Key]) -> list[tuple[Key, Fuzz]]:
        """The keys whose every message has not had its final reply (choice 0) yet."""
        return [(k, self.last_message[k]) for k in keys if self.finals[(*k, 0)] < self.sent[k]]

    def in_flight(self) -> float:
        text = self.http.get("/metrics").text
        (line,) = [line for line in text.splitlines() if line.startswith("rivulet_num_requests_in_flight ")]
        return float(line.split()[1])

    def settle(self, keys: Iterable[Key], timeout_s: float) -> bool:
        """Wait until ``keys`` had their final replies and no request is in flight (later choices
        too), then take the replies still on their way; False at the timeout."""
        deadline = time.monotonic() + timeout_s
        while self.missing(keys) or self.in_flight() > 0:
            if time.monotonic() > deadline:
                return False
            self.receive(20)
        while self.receive(5):
            pass
        return True

    def close(self) -> None:
        self.http.close()
        self.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def fuzz_client(engine: HttpEngine) -> Iterator[FuzzClient]:
    client = FuzzClient(engine)
    yield client
    client.close()


@pytest.fixture(scope="module")
def engine_pids(engine: HttpEngine) -> dict[str, int]:
    return dict(engine.engine.child_pids)


def _same_processes(engine: HttpEngine, pids: dict[str, int]) -> None:
    assert engine.engine.proc.poll() is None, "the launcher exited"
    assert engine.engine.child_pids == pids and all(pid_alive(pid) for pid in pids.values())


@settings(
    max_examples=FUZZ_BATCHES,
    deadline=None,
    database=None,
    derandomize=not os.environ.get("RIVULET_FUZZ_RANDOM"),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
@given(batch=st.lists(messages, min_size=BATCH_SIZE, max_size=BATCH_SIZE))
def test_fuzzed_client_frames(
    engine: HttpEngine, engine_pids: dict[str, int], fuzz_client: FuzzClient, batch: list[Fuzz]
) -> None:
    keys = {key for key in map(fuzz_client.send, batch) if key is not None}
    if not fuzz_client.settle(keys, LONG_REQUEST_S):
        fuzz_client.abort(keys)
        settled = fuzz_client.settle(keys, BATCH_TIMEOUT_S)
        assert settled, f"no final reply within {BATCH_TIMEOUT_S} s to {fuzz_client.missing(keys)[:3]}"
    fuzz_client.examples += 1
    if fuzz_client.examples % IDLE_CHECK_EVERY == 0:
        wait_idle_and_free(engine.base_url)
    _same_processes(engine, engine_pids)


def test_after_the_fuzz_the_engine_serves(
    engine: HttpEngine, engine_pids: dict[str, int], fuzz_client: FuzzClient
) -> None:
    assert fuzz_client.settle(fuzz_client.sent, BATCH_TIMEOUT_S)
    wait_idle_and_free(engine.base_url)
    readable, finals = sum(fuzz_client.sent.values()), sum(fuzz_client.finals.values())
    print(
        f"fuzz: {fuzz_client.messages} messages ({readable} with a readable rid), "
        f"{fuzz_client.replies} replies ({finals} final), {fuzz_client.aborts} aborts"
    )
    with Client(engine.engine.endpoint, timeout_s=30) as c:
        reply = c.generate("Hello", max_new_tokens=4)
    assert reply.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    _same_processes(engine, engine_pids)
