"""500 requests from 64 concurrent clients, mixed HTTP/ZMQ, streaming or not, some aborting or
disconnecting, some with n > 1 choices: every request (every choice) is accounted for, the KV
pool ends all-free, memory stays bounded."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec

from client import AsyncClient
from tests.tokenizer_proc.http.server import HttpEngine, http_engine, metrics, rss_kib, wait_idle_and_free

NUM_REQUESTS = 500
NUM_CLIENTS = 64
NUM_ZMQ_CONNECTIONS = 8  # the ZMQ clients share these (AsyncClient multiplexes requests)
LONG_TOKENS = 400
# RSS growth allowed over the 500 requests, after a warm-up of the same mix. The front door and
# the scheduler must not grow at all to speak of (measured: < 1 MiB). The CPU worker's RSS climbs
# for a while after start as the allocator keeps buffers of ever new batch shapes: measured
# +156, +75, +44, +38 MiB over four successive 500-request runs, a decelerating climb.
RSS_GROWTH_BOUND_KIB = {"tokenizer": 16 * 1024, "scheduler": 16 * 1024, "gpu_worker": 256 * 1024}
# What each request index does, cycling: most finish, some are aborted or disconnected mid-way.
KINDS = ("http_stream", "http_whole", "chat_stream", "chat_whole", "http_disconnect",
         "zmq_stream", "zmq_whole", "zmq_abort", "http_stream", "http_whole",
         "http_choices", "choices_disconnect")  # fmt: skip
CHOICES = {"http_choices": 3, "choices_disconnect": 2}  # n of the kinds with n > 1


@dataclass
class Outcome:
    kind: str
    end: str  # a finish_reason, or "disconnected" (the client hung up; the server aborts)
    tokens: int
    max_tokens: int
    choices: int = 1


async def _http(client: httpx.AsyncClient, kind: str, max_tokens: int, rng: random.Random) -> Outcome:
    chat, n = kind.startswith("chat"), CHOICES.get(kind, 1)
    disconnect = kind.endswith("disconnect")
    ignore_eos = disconnect or rng.random() < 0.5
    body: dict[str, object] = {"max_tokens": max_tokens, "ignore_eos": ignore_eos, "temperature": 0.8, "n": n}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Tell me about river {rng.randrange(1000)}"}]
    else:
        body["prompt"] = f"Once upon a time {rng.randrange(1000)}"
    url = "/v1/chat/completions" if chat else "/v1/completions"
    if not kind.endswith(("stream", "disconnect")):
        reply = await client.post(url, json=body)
        assert reply.status_code == 200, reply.text
        data = reply.json()
        ends = {choice["finish_reason"] for choice in data["choices"]}
        assert len(data["choices"]) == n and ends <= {"stop", "length"}, data
        end = "length" if ends == {"length"} else "stop"
        return Outcome(kind, end, data["usage"]["completion_tokens"], max_tokens * n, n)
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    end, tokens = "none", -1
    async with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if disconnect:  # leaving the block closes the socket
                return Outcome(kind, "disconnected", 0, max_tokens, n)
            chunk = msgspec.json.decode(line[6:])
            assert "error" not in chunk, chunk
            if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                end = chunk["choices"][0]["finish_reason"]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return Outcome(kind, end, tokens, max_tokens)


async def _zmq(client: AsyncClient, kind: str, max_tokens: int, rng: random.Random) -> Outcome:
    prompt = f"The river {rng.randrange(1000)} flows"
    if kind == "zmq_whole":
        out = await client.generate(prompt, max_new_tokens=max_tokens, temperature=0.8)
        assert out.usage is not None and out.finish_reason is not None
        return Outcome(kind, out.finish_reason.value, out.usage.completion_tokens, max_tokens)
    stream = await client.generate(prompt, stream=True, max_new_tokens=max_tokens, ignore_eos=True)
    aborted = False
    async for delta in stream:
        if kind == "zmq_abort" and not aborted:
            aborted = True
            await client.abort(delta.rid)  # the stream then ends with ABORT
        if delta.finish_reason is not None:
            assert delta.usage is not None
            return Outcome(kind, delta.finish_reason.value, delta.usage.completion_tokens, max_tokens)
    raise AssertionError("a ZMQ stream ended without a final reply")


async def _run_load(engine: HttpEngine, num_requests: int, seed: int) -> list[Outcome]:
    """``num_requests`` requests, KINDS cycling, spread over NUM_CLIENTS concurrent workers."""
    next_index = iter(range(num_requests))
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=NUM_CLIENTS, max_keepalive_connections=NUM_CLIENTS)
    zmq_clients = [AsyncClient(engine.engine.endpoint, timeout_s=60) for _ in range(NUM_ZMQ_CONNECTIONS)]
    async with httpx.AsyncClient(base_url=engine.base_url, limits=limits, timeout=60) as http:

        async def worker(w: int) -> None:
            rng = random.Random(seed * 1000 + w)
            for i in next_index:
                kind = KINDS[i % len(KINDS)]
                # Those cut short must not finish first: long enough that the hang-up or abort wins.
                long = kind in ("http_disconnect", "choices_disconnect", "zmq_abort")
                max_tokens = LONG_TOKENS if long else rng.randint(1, 16)
                if kind.startswith("zmq"):
                    outcomes.append(await _zmq(zmq_clients[w % NUM_ZMQ_CONNECTIONS], kind, max_tokens, rng))
                else:
                    outcomes.append(await _http(http, kind, max_tokens, rng))

        try:
            await asyncio.wait_for(asyncio.gather(*(worker(w) for w in range(NUM_CLIENTS))), 240)
        finally:
            for c in zmq_clients:
                await c.close()
    return outcomes


def _children_rss_kib(engine: HttpEngine) -> dict[str, int]:
    return {name: rss_kib(pid) for name, pid in engine.engine.child_pids.items()}


def test_500_requests_from_64_clients_all_accounted_for(engine: HttpEngine) -> None:
    _check_load(engine)


def test_the_same_load_on_two_data_parallel_replicas(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """--dp-size 2: every request accounted for across the replicas, each replica's KV free after."""
    with http_engine(tiny_llama_dir, tmp_path, "--served-model-name", "tiny", "--dp-size", "2") as engine:
        _check_load(engine)
        m = metrics(engine.base_url)
        assert all(m[f'rivulet_replica_requests_routed_total{{replica="{i}"}}'] > 100 for i in range(2))
        assert all(m[f'rivulet_replica_num_requests_running{{replica="{i}"}}'] == 0 for i in range(2))


def _check_load(engine: HttpEngine) -> None:
    asyncio.run(_run_load(engine, 2 * NUM_CLIENTS, seed=1))  # warm-up: allocator pools, caches
    wait_idle_and_free(engine.base_url)
    rss_before, before = _children_rss_kib(engine), metrics(engine.base_url)

    outcomes = asyncio.run(_run_load(engine, NUM_REQUESTS, seed=2))

    after = wait_idle_and_free(engine.base_url, 15.0)  # every KV page back, nothing running or queued
    rss_after = _children_rss_kib(engine)
    ends = Counter(o.end for o in outcomes)
    assert len(outcomes) == NUM_REQUESTS and set(ends) <= {"stop", "length", "abort", "disconnected"}, ends
    for o in outcomes:
        if o.end in ("stop", "length"):
            assert o.choices <= o.tokens <= o.max_tokens and (o.end == "stop" or o.tokens == o.max_tokens), o
    assert ends["abort"] == sum(o.kind == "zmq_abort" for o in outcomes)
    choices = Counter[str]()
    for o in outcomes:
        choices[o.end] += o.choices

    def delta(reason: str) -> float:
        key = f'rivulet_requests_finished_total{{finish_reason="{reason}"}}'
        return after[key] - before[key]

    # The server saw every request end: the clients' aborts and hang-ups as "abort", none as "error".
    # Each choice of an n > 1 request finishes as a request of its own.
    assert delta("stop") + delta("length") == choices["stop"] + choices["length"]
    assert delta("abort") == choices["abort"] + choices["disconnected"]
    assert delta("error") == 0
    grown = {name: rss_after[name] - rss_before[name] for name in rss_after}
    bound = {name: RSS_GROWTH_BOUND_KIB[name.split(".")[0]] for name in grown}  # gpu_worker.1: a worker
    assert all(grown[name] < bound[name] for name in grown), (grown, rss_before)
    print(f"load: {dict(ends)}; RSS growth KiB {grown}; RSS before KiB {rss_before}")
