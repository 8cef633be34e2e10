"""--dp-size 2: two scheduler + worker replicas behind one tokenizer, on the real launcher.

Every request is served and answered as with one replica (greedy: the same tokens), requests
spread over both replicas, a shared prefix stays on one (its cache hits show in usage), aborts
and n > 1 choices reach the right replica, each worker runs on its own core, and every replica's
KV pool is free again at the end.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from client import Client
from protocol.messages import FinishReason
from tests.tokenizer_proc.http.server import HttpEngine, http_engine, metrics, wait_idle_and_free

PROMPTS = [f"Tell me a story about the number {i}." for i in range(8)]


@pytest.fixture(scope="module")
def dp2(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpEngine]:
    with http_engine(tiny_llama_dir, tmp_path_factory.mktemp("dp2"), "--dp-size", "2") as e:
        yield e


@pytest.fixture(scope="module")
def dp1(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpEngine]:
    with http_engine(tiny_llama_dir, tmp_path_factory.mktemp("dp1")) as e:
        yield e


def complete(engine: HttpEngine, prompt: str, **fields: object) -> dict:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **fields}
    reply = httpx.post(engine.v1 + "/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def routed(engine: HttpEngine) -> list[float]:
    m = metrics(engine.base_url)
    return [m[f'rivulet_replica_requests_routed_total{{replica="{i}"}}'] for i in range(2)]


def test_two_replicas_each_on_its_own_core(dp2: HttpEngine) -> None:
    pids = dp2.engine.child_pids
    assert {"gpu_worker", "gpu_worker.1", "scheduler", "scheduler.1", "tokenizer"} <= set(pids)
    cores = os.sched_getaffinity(0)
    if len(cores) >= 2:
        mine = [os.sched_getaffinity(pids[name]) for name in ("gpu_worker", "gpu_worker.1")]
        assert len(mine[0]) == len(mine[1]) == len(cores) // 2 and not mine[0] & mine[1]


def test_concurrent_requests_spread_and_equal_one_replica(dp2: HttpEngine, dp1: HttpEngine) -> None:
    before = routed(dp2)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: complete(dp2, p)["choices"][0]["text"], PROMPTS))
    expected = [complete(dp1, p)["choices"][0]["text"] for p in PROMPTS]
    assert got == expected
    after = routed(dp2)
    assert all(a - b >= 2 for a, b in zip(after, before, strict=True)), (before, after)
    wait_idle_and_free(dp2.base_url)


def test_a_shared_prefix_stays_on_one_replica(dp2: HttpEngine) -> None:
    system = "You are a careful assistant who answers in one line. " * 12
    before = routed(dp2)
    replies = [complete(dp2, system + f"Question {i}?") for i in range(4)]
    after = routed(dp2)
    moved = [a - b for a, b in zip(after, before, strict=True)]
    assert sorted(moved) == [0, 4], f"the four requests went {moved}"
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in replies[1:])


def test_aborts_and_choices_on_both_replicas(dp2: HttpEngine) -> None:
    with Client(dp2.engine.endpoint, timeout_s=60) as c:
        for i in range(2):  # one request per replica, at least: both are aborted mid-stream
            stream = c.generate(PROMPTS[i], stream=True, max_new_tokens=400, ignore_eos=True, rid=f"a{i}")
            first = next(stream)
            c.abort(first.rid)
            assert [r for r in stream][-1].finish_reason is FinishReason.ABORT
        finals = c.generate_choices(PROMPTS[3], n=3, max_new_tokens=6, temperature=1.0, seed=5)
    assert [f.index for f in finals] == [0, 1, 2] and all(
        f.usage and f.usage.completion_tokens == 6 for f in finals
    )
    m = wait_idle_and_free(dp2.base_url)
    for i in range(2):
        assert m[f'rivulet_replica_num_requests_running{{replica="{i}"}}'] == 0
