"""Faults under load: a SIGKILLed process fails every waiting client fast and stops the engine;
SIGTERM with --shutdown-timeout lets running requests finish, and fails the rest."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import pytest

from client import AsyncClient, EngineError
from tests.integration.engine import wait_gone
from tests.tokenizer_proc.http.server import HttpEngine, http_engine, metrics

LONG = 1000  # tokens: ~10 s here, no such request finishes on its own before the fault
SHORT = 150  # tokens: well within the drain below, and running past /metrics' next update
ERROR_WITHIN_S = 10.0  # every waiting client must hear of the fault within this


async def _http_stream(http: httpx.AsyncClient, max_tokens: int, started: asyncio.Event) -> str:
    """Stream a completion; return its finish_reason, or "error: ..." for an error event or a cut."""
    body = {"prompt": "Rivers run", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                started.set()
                chunk = msgspec.json.decode(line[6:])
                if "error" in chunk:
                    return f"error: {chunk['error']['message']}"
                if chunk["choices"][0]["finish_reason"]:
                    return str(chunk["choices"][0]["finish_reason"])
    except httpx.HTTPError as exc:  # the server died: a closed connection is an error, not a hang
        return f"error: {type(exc).__name__}"
    return "error: the stream ended without a finish_reason"


async def _http_whole(http: httpx.AsyncClient, max_tokens: int, started: asyncio.Event) -> str:
    started.set()
    body = {"prompt": "Rivers run", "max_tokens": max_tokens, "ignore_eos": True}
    try:
        reply = await http.post("/v1/completions", json=body)
    except httpx.HTTPError as exc:
        return f"error: {type(exc).__name__}"
    if reply.status_code != 200:
        return f"error: {reply.status_code} {reply.json()['error']['message']}"
    return str(reply.json()["choices"][0]["finish_reason"])


async def _zmq(client: AsyncClient, max_tokens: int, started: asyncio.Event) -> str:
    try:
        stream = await client.generate("Rivers run", stream=True, max_new_tokens=max_tokens, ignore_eos=True)
        async for delta in stream:
            started.set()
            if delta.finish_reason is not None:
                return delta.finish_reason.value
    except EngineError as exc:
        return f"error: {exc}"
    return "error: the stream ended without a finish_reason"


async def _under_load(
    e: HttpEngine, max_tokens: list[int], fault: Callable[[], None], min_running: int
) -> list[tuple[str, float]]:
    """Start an HTTP stream, an HTTP whole request and a ZMQ stream per ``max_tokens``, wait
    until ``min_running`` run, inject ``fault``; return (outcome, seconds after the fault)."""
    zmq_client = AsyncClient(e.engine.endpoint, timeout_s=60)
    async with httpx.AsyncClient(base_url=e.base_url, timeout=60) as http:
        started = [asyncio.Event() for _ in range(3 * len(max_tokens))]
        tasks: list[asyncio.Task[str]] = []
        for i, n in enumerate(max_tokens):
            events = started[3 * i : 3 * i + 3]
            tasks += [
                asyncio.create_task(_http_stream(http, n, events[0])),
                asyncio.create_task(_http_whole(http, n, events[1])),
                asyncio.create_task(_zmq(zmq_client, n, events[2])),
            ]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
        # /metrics shows the running count at most every STATS_INTERVAL_S while the engine is busy: a
        # short request may finish before it shows all of them, and then the count never gets there.
        while metrics(e.base_url)["rivulet_num_requests_running"] < min_running and not any(
            t.done() for t in tasks
        ):
            await asyncio.sleep(0.05)
        fault_s = time.monotonic()
        fault()
        ended: list[tuple[str, float]] = []
        for outcome in await asyncio.wait_for(asyncio.gather(*tasks), 60):
            ended.append((outcome, time.monotonic() - fault_s))
    await zmq_client.close()
    return ended


@pytest.mark.parametrize(
    ("victim", "flags"),
    [("gpu_worker", ()), ("tokenizer", ()), ("scheduler", ()), ("gpu_worker.1", ("--dp-size", "2"))],
    ids=["gpu_worker", "tokenizer", "scheduler", "dp2-replica-1-worker"],
)
def test_sigkill_fails_every_waiting_client_and_stops_the_engine(
    victim: str, flags: tuple[str, ...], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    with http_engine(tiny_llama_dir, tmp_path, "--served-model-name", "tiny", *flags) as e:
        pid = e.engine.child_pids[victim]
        ended = asyncio.run(_under_load(e, [LONG] * 4, lambda: os.kill(pid, signal.SIGKILL), min_running=12))
        assert len(ended) == 12 and all(outcome.startswith("error") for outcome, _ in ended), ended
        # Outcomes are gathered in order, so the latest end is the slowest client's.
        assert max(seconds for _, seconds in ended) < ERROR_WITHIN_S, ended
        assert e.engine.proc.wait(15) != 0
        assert f"{victim} exited with code" in e.engine.log()
        assert not wait_gone(list(e.engine.child_pids.values()), 5.0)


def test_sigterm_drains_running_requests_for_the_shutdown_timeout(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    drain_s = 4.0
    with http_engine(tiny_llama_dir, tmp_path, "--shutdown-timeout", str(drain_s)) as e:
        refused: list[httpx.Response] = []

        def sigterm_then_try_a_new_request() -> None:
            e.engine.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)  # the tokenizer is draining now
            refused.append(httpx.post(e.base_url + "/v1/completions", json={"prompt": "x"}, timeout=10))

        ended = asyncio.run(_under_load(e, [SHORT, LONG], sigterm_then_try_a_new_request, min_running=6))
        short, long = ended[:3], ended[3:]
        assert [outcome for outcome, _ in short] == ["length"] * 3, ended  # drained to the end
        # The long ones finish or, at the deadline, get the shutdown error; none hangs.
        assert all(o == "length" or "shutting down" in o for o, _ in long), ended
        assert refused[0].status_code == 503 and refused[0].json()["error"]["code"] == "shutting_down"
        assert e.engine.proc.wait(drain_s + 10) == 0
        assert not wait_gone(list(e.engine.child_pids.values()), 5.0)
