"""A ZMQ client that goes away mid-request (its socket closes) has its requests aborted and freed."""

from __future__ import annotations

import time

import zmq

from client import Client
from protocol.messages import GenerateRequest, SamplingParams
from protocol.transport import Codec, make_socket
from tests.tokenizer_proc.http.server import HttpEngine, metrics, wait_idle_and_free

ABORTED = 'rivulet_requests_finished_total{finish_reason="abort"}'
LONG = SamplingParams(max_new_tokens=900, ignore_eos=True)


def test_streaming_client_that_closes_is_aborted(engine: HttpEngine) -> None:
    before = metrics(engine.base_url)[ABORTED]
    client = Client(engine.engine.endpoint, timeout_s=30)
    stream = client.generate("Rivers run", stream=True, max_new_tokens=900, ignore_eos=True)
    assert next(stream).finish_reason is None  # running
    client.close()  # no abort sent: the socket just goes away
    m = wait_idle_and_free(engine.base_url, 10.0)  # the next token's reply fails, which aborts it
    assert m[ABORTED] == before + 1


def test_waiting_client_that_closes_is_found_by_the_probe(engine: HttpEngine) -> None:
    before = metrics(engine.base_url)[ABORTED]
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, engine.engine.endpoint, bind=False)
    sock.send(Codec(GenerateRequest).encode(GenerateRequest(rid="w", prompt="Rivers run", sampling=LONG)))
    deadline = time.monotonic() + 20
    while metrics(engine.base_url)["rivulet_num_requests_running"] < 1:  # admitted and decoding
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    ctx.destroy(linger=0)  # a non-streaming request gets no reply before the end: only the probe can tell
    m = wait_idle_and_free(engine.base_url, 10.0)
    assert m[ABORTED] == before + 1
