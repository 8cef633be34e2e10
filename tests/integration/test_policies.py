"""Scheduling policies end to end: four engines, one mixed workload, the same tokens from all of them.

Each engine runs a different admission / interleaving / KV setting; greedy and
seeded-sampling requests alike must produce exactly the tokens of the fcfs
engine, which runs without the prefix cache while the others use it (sampling
noise is a pure function of (seed, position)), streamed without a duplicated or
lost delta, even where a tiny KV pool forces retraction and eviction. Aborts are
checked in all three states a request can be in.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from client import Client
from protocol import FinishReason, GenerateOutput
from tests.integration.engine import RunningEngine, running_engine

KV_TOKENS = 1024  # the tiny model's context: a leaked page shows up as a request that no longer fits
COMMON = (
    "--dtype",
    "float64",
    "--page-size",
    "16",
    "--max-prefill-tokens",
    "64",
    "--chunked-prefill-size",
    "32",
)
# Four engines, not one per knob: start-up (~10 s each) dominates this module's time.
CONFIGS: dict[str, tuple[str, ...]] = {
    "fcfs": ("--kv-cache-tokens", str(KV_TOKENS), "--disable-radix-cache"),
    "pack": ("--kv-cache-tokens", str(KV_TOKENS), "--schedule-policy", "pack"),
    # Small chunks: the abort tests below catch a long prompt between two of its chunks.
    "max-running": (
        "--kv-cache-tokens", str(KV_TOKENS), "--max-running-requests", "2", "--chunked-prefill-size", "8",
    ),
    # A 288-token pool for ~1500 tokens of work; the reservation for running requests decays back to
    # almost nothing within 4 steps of each retraction, so retraction comes again and again (in mixed
    # mode, with a decode-only batch before every mixed one).
    "decode-first+tiny-kv": (
        "--kv-cache-tokens", "288", "--schedule-conservativeness", "0.05",
        "--new-token-ratio-decay-steps", "4", "--decode-first", "--enable-mixed-chunk",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Job:
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    seed: int


@dataclass
class Outcome:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    completion_tokens: int
    cached_tokens: int = field(default=0, compare=False)  # differs with the cache on and off


def mixed_workload() -> list[Job]:
    rng = random.Random(4)
    lens = [3, 40, 20, 7, 12, 15, 30, 60, 5, 9, 50, 160]
    system = [rng.randrange(3, 49152) for _ in range(64)]  # four requests share it
    prompts = [
        (system if i in (1, 4, 9, 10) else []) + [rng.randrange(3, 49152) for _ in range(n)]
        for i, n in enumerate(lens)
    ]
    prompts[10] = prompts[9]  # and two are identical
    return [
        Job(
            input_ids=prompts[i],
            max_new_tokens=rng.randint(60, 120),
            temperature=0.0 if i % 2 == 0 else 0.8,
            seed=1000 + i,
        )
        for i, n in enumerate(lens)
    ]


@contextlib.contextmanager
def running_engines(model: Path, base: Path) -> Iterator[dict[str, RunningEngine]]:
    """Every configuration's engine, started at once (start-up dominates and overlaps well)."""
    stop = threading.Event()
    engines: dict[str, RunningEngine] = {}
    errors: list[BaseException] = []

    def serve(name: str, args: tuple[str, ...]) -> None:
        try:
            (base / name).mkdir()
            with running_engine(model, base / name, *COMMON, *args) as engine:
                engines[name] = engine
                stop.wait()
        except BaseException as exc:  # re-raised in the test's thread below
            errors.append(exc)

    threads = [threading.Thread(target=serve, args=item) for item in CONFIGS.items()]
    for t in threads:
        t.start()
    try:
        while len(engines) + len(errors) < len(CONFIGS) and any(t.is_alive() for t in threads):
            time.sleep(0.1)
        if errors:
            raise errors[0]
        yield engines
    finally:
        stop.set()
        for t in threads:
            t.join(30)


@pytest.fixture(scope="module")
def engines(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, RunningEngine]]:
    with running_engines(tiny_llama_dir, tmp_path_factory.mktemp("policies")) as e:
        yield e


def run_job(endpoint: str, job: Job) -> Outcome:
    with Client(endpoint, timeout_s=120) as client:
        chunks = list(
            client.generate(
                input_ids=job.input_ids,
                max_new_tokens=job.max_new_tokens,
                temperature=job.temperature,
                seed=job.seed,
                ignore_eos=True,
                stream=True,
            )
        )
    assert all(c.finish_reason is None for c in chunks[:-1]), "finish_reason only on the last delta"
    usage = chunks[-1].usage
    assert usage is not None
    return Outcome(
        token_ids=[t for c in chunks for t in c.token_ids],
        text="".join(c.text for c in chunks),
        finish_reason=chunks[-1].finish_reason,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
    )


def run_workload(engine: RunningEngine, jobs: list[Job], out: dict[int, Outcome]) -> None:
    """Every job from its own client thread, all at once."""

    def one(i: int) -> None:
        out[i] = run_job(engine.endpoint, jobs[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)


@pytest.mark.timeout(300)
def test_every_policy_gives_the_fcfs_tokens(engines: dict[str, RunningEngine]) -> None:
    jobs = mixed_workload()
    results: dict[str, dict[int, Outcome]] = {name: {} for name in engines}
    runners = [threading.Thread(target=run_workload, args=(engines[n], jobs, results[n])) for n in engines]
    for t in runners:
        t.start()
    for t in runners:
        t.join(240)
    baseline = results["fcfs"]
    assert sorted(baseline) == list(range(len(jobs))), "every fcfs request must finish"
    for i, job in enumerate(jobs):
        got = baseline[i]
        assert got.finish_reason is FinishReason.LENGTH and len(got.token_ids) == job.max_new_tokens
        assert got.completion_tokens == job.max_new_tokens
    for name, outcomes in results.items():
        assert sorted(outcomes) == list(range(len(jobs))), f"{name}: a request did not finish"
        for i in range(len(jobs)):
            assert outcomes[i] == baseline[i], f"{name}: request {i} differs from fcfs"
    assert not any(o.cached_tokens for o in baseline.values()), "fcfs runs without the prefix cache"
    assert all(any(o.cached_tokens >= 64 for o in results[n].values()) for n in ("pack", "max-running"))
    retractions = engines["decode-first+tiny-kv"].log().count("retracted rid")
    assert retractions >= 3, f"the tiny pool must force retraction, saw {retractions}"


# ------------------------------------------------- aborts (on the engine of 2 running requests)


def _whole_pool_fits(client: Client) -> None:
    """A request needing 63 of the 64 pages: only fits if every aborted request's pages came back."""
    out = client.generate(input_ids=[7] * (KV_TOKENS - 24), max_new_tokens=8, temperature=0, ignore_eos=True)
    assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 8


def _drain(stream: Iterator[GenerateOutput]) -> list[GenerateOutput]:
    return list(stream)


@pytest.mark.timeout(120)
def test_abort_waiting_and_running_requests(engines: dict[str, RunningEngine]) -> None:
    endpoint = engines["max-running"].endpoint
    with Client(endpoint, timeout_s=60) as client:
        a, b = (
            client.generate(input_ids=[5 + i] * 20, max_new_tokens=480, ignore_eos=True, stream=True, rid=rid)
            for i, rid in enumerate("ab")
        )
        # Both hold a req_pool_idx (the engine's two), and their 2 x 32 pages fit the 64: no retraction.
        first_a, first_b = next(a), next(b)
        assert first_a.finish_reason is None and first_b.finish_reason is None
        waiting = client.generate(input_ids=[11] * 30, max_new_tokens=4, temperature=0, stream=True, rid="w")
        time.sleep(0.2)
        client.abort("w")
        w_chunks = _drain(waiting)
        assert w_chunks[-1].finish_reason is FinishReason.ABORT
        assert not any(c.token_ids for c in w_chunks), "aborted while waiting for a req_pool_idx: no token"
        assert next(a).finish_reason is None, "the running ones carry on"
        client.abort("a")
        a_rest = _drain(a)
        assert a_rest[-1].finish_reason is FinishReason.ABORT
        client.abort("b")
        assert _drain(b)[-1].finish_reason is FinishReason.ABORT
        _whole_pool_fits(client)


@pytest.mark.timeout(120)
def test_abort_the_chunked_request_between_its_chunks(engines: dict[str, RunningEngine]) -> None:
    engine = engines["max-running"]
    with Client(engine.endpoint, timeout_s=60) as client:
        seen = engine.log().count("#new-token: 8,")
        last_chunks = engine.log().count("#new-seq: 1, #new-token: 4,")
        # 112 chunks of 8 tokens, then one of 4.
        stream = client.generate(input_ids=[13] * 900, max_new_tokens=8, temperature=0, stream=True, rid="c")
        deadline = time.monotonic() + 30
        while engine.log().count("#new-token: 8,") <= seen:  # its first chunk ran: it is the chunked_req
            assert time.monotonic() < deadline, "the long prompt's first chunk never ran"
            time.sleep(0.002)
        client.abort("c")
        chunks = _drain(stream)
        assert chunks[-1].finish_reason is FinishReason.ABORT
        assert not any(c.token_ids for c in chunks), "aborted mid-prompt: no token was sampled"
        assert engine.log().count("#new-seq: 1, #new-token: 4,") == last_chunks, "its last chunk never ran"
        _whole_pool_fits(client)


@pytest.mark.timeout(120)
def test_cache_salts_do_not_share_and_flush_empties_the_cache(engines: dict[str, RunningEngine]) -> None:
    with Client(engines["pack"].endpoint, timeout_s=60) as client:

        def cached(salt: str | None) -> int:
            out = client.generate(input_ids=[21] * 80, max_new_tokens=2, ignore_eos=True, cache_salt=salt)
            assert out.usage is not None
            return out.usage.cached_tokens

        assert cached("alice") == 0
        assert cached("alice") == 64, "the 4 full pages of the 79 tokens before the last"
        assert cached("bob") == 0, "another tenant's salt shares nothing"
        assert cached(None) == 0
        client.flush_cache()
        assert cached("alice") == 0, "flushed"
    assert "flushed the prefix cache" in engines["pack"].log()
