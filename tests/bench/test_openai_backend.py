"""The openai backend against a fake OpenAI-compatible SSE server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from bench.lib.backends import OpenAIBackend, decoded_count, parse_event
from bench.lib.llama_cpp import REQUEST_FIELDS
from bench.lib.metrics import RequestResult, summarize
from bench.lib.serving import run_requests
from bench.lib.workloads import WorkItem


class FakeServer:
    """Answers POST /v1/completions with one SSE event per token, then usage and [DONE].

    A prompt starting with "FAIL" gets HTTP 400; one starting with "CUT" ends without finish_reason.
    """

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        length = int(
            next(h.split(":")[1] for h in head.split("\r\n") if h.lower().startswith("content-length"))
        )
        body = json.loads(await reader.readexactly(length))
        self.bodies.append(body)
        if body["prompt"].startswith("FAIL"):
            msg = b'{"error": {"message": "bad max_tokens"}}'
            writer.write(
                b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(msg)
            )
            writer.write(msg)
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
            for event in self.events(body):
                writer.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                await writer.drain()
                await asyncio.sleep(0.001)
            writer.write(b"data: [DONE]\n\n")
        await writer.drain()
        writer.close()

    def events(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        n = body["max_tokens"]
        if body.get("timings_per_token"):
            return self.timed_events(n)
        out: list[dict[str, Any]] = [{"choices": [{"text": "", "finish_reason": None}]}]  # a role-only chunk
        out += [{"choices": [{"text": f" w{i}", "finish_reason": None}]} for i in range(n)]
        if body["prompt"].startswith("CUT"):
            return out
        out[-1]["choices"][0]["finish_reason"] = "length"
        usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": n,
                 "prompt_tokens_details": {"cached_tokens": 1}}  # fmt: skip
        return [*out, {"choices": [], "usage": usage}]

    @staticmethod
    def timed_events(n: int) -> list[dict[str, Any]]:
        """llama-server's stream with ``timings_per_token``: a chunk a token, each with the count
        decoded so far; the tokens show no text (a random model's unused ids), but the second."""
        out = [{"choices": [{"text": " x" if i == 1 else "", "finish_reason": None}],
                "timings": {"predicted_n": i + 1}} for i in range(n)]  # fmt: skip
        final = {"choices": [{"text": "", "finish_reason": "length"}], "timings": {"predicted_n": n},
                 "usage": {"prompt_tokens": 2, "completion_tokens": n}}  # fmt: skip
        return [*out, final]


async def serve_and_run(
    items: list[WorkItem], fields: dict[str, Any] | None = None
) -> tuple[list[RequestResult], FakeServer]:
    """Start the fake server on a free loopback port, run ``items`` through the openai backend
    (``fields`` added to every body), stop it."""
    fake = FakeServer()
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    backend = OpenAIBackend(f"http://127.0.0.1:{port}", "m", temperature=0.0, sampling=fields)
    try:
        results = await run_requests(backend, items, [0.0] * len(items), max_concurrency=2, progress=False)
    finally:
        await backend.close()
        server.close()
        await server.wait_closed()
    return results, fake


def test_streamed_tokens_usage_and_errors() -> None:
    items = [WorkItem("a b c", None, 5, True), WorkItem("d e", None, 3, False),
             WorkItem("FAIL", None, 2, True), WorkItem("CUT x", None, 2, True)]  # fmt: skip
    (ok, ok2, failed, cut), fake = asyncio.run(serve_and_run(items))
    assert (len(ok.token_times_s), ok.completion_tokens, ok.prompt_tokens, ok.cached_tokens) == (5, 5, 3, 1)
    assert ok.token_times_s == sorted(ok.token_times_s) and ok.ok
    assert len(ok2.token_times_s) == 3 and ok2.ok
    assert failed.error is not None and "HTTP 400" in failed.error and "bad max_tokens" in failed.error
    assert cut.error is not None and "finish_reason" in cut.error
    s = summarize([ok, ok2, failed, cut])
    assert (s.num_failed, s.completion_tokens, s.prompt_tokens) == (2, 8, 5)
    body = next(b for b in fake.bodies if b["prompt"] == "a b c")
    assert body["stream"] is True and body["max_tokens"] == 5 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "m"


def test_parse_event_reads_text_finish_and_usage() -> None:
    delta, done = parse_event({"choices": [{"text": "hi", "finish_reason": "stop"}]})
    assert delta.num_tokens == 1 and done
    delta, done = parse_event({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}})
    assert (delta.num_tokens, delta.prompt_tokens, delta.completion_tokens, done) == (0, 4, 2, False)
    with pytest.raises(RuntimeError, match="server error"):
        parse_event({"error": {"message": "overloaded"}})


def test_tokens_without_text_counted_from_the_servers_count() -> None:
    """llama-server renders unused ids as empty text: with llama_cpp.REQUEST_FIELDS every token
    is still timed where its chunk came, so TPOT exists (it was None: "fewer than 2 tokens")."""
    (res,), fake = asyncio.run(serve_and_run([WorkItem("a b", None, 6, True)], REQUEST_FIELDS))
    assert fake.bodies[-1]["timings_per_token"] is True and fake.bodies[-1]["ignore_eos"] is True
    assert (len(res.token_times_s), res.completion_tokens) == (6, 6) and res.ok
    assert res.tpot_s is not None and res.tpot_s > 0
    assert decoded_count({"timings": {"predicted_n": 3}}) == 3
    assert decoded_count({"choices": [{"text": "a"}]}) is None
