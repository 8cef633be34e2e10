"""The radix cache inside the scheduler: hits, in-batch dedup, lpm, namespaces, eviction, flush."""

from __future__ import annotations

import random

import pytest

from scheduler_proc.config import SchedulerConfig
from tests.scheduler_proc.harness import Driver, batch_kinds, reference_output


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def config(**overrides: object) -> SchedulerConfig:
    base: dict = dict(
        overlap_schedule=False, num_pages=4096, context_len=4096, page_size=16, chunked_prefill_size=512
    )
    base.update(overrides)
    return SchedulerConfig(**base)


def prompt_tokens_computed(d: Driver) -> int:
    """Tokens of prefill rows (everything but 1-token decode rows of running requests)."""
    kinds = batch_kinds(d.batches)
    total = 0
    for kind, batch in zip(kinds, d.batches, strict=True):
        for sampler, ext in zip(batch.sampler, batch.extend_lens, strict=True):
            if not (kind in "DM" and sampler is None and ext == 1):
                total += ext
    return total


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("cache", [True, False])
def test_a_shared_prefix_is_computed_once_across_requests(ps: int, cache: bool) -> None:
    d = Driver(config(page_size=ps, num_pages=4096 // ps, disable_radix_cache=not cache))
    system = tokens(64, 0)
    prompts = {rid: system + tokens(8, 100 + rid) for rid in range(8)}
    for rid, p in prompts.items():
        d.submit(rid, p, 4)
    d.run()
    for rid, p in prompts.items():
        assert d.tokens[rid] == reference_output(p, 4, [], 4096)[0]
    decode_tokens = 8 * 3
    computed = d.worker.extend_tokens - decode_tokens
    assert computed == (64 + 8 * 8 if cache else 72 * 8), "the 64 shared tokens once, then 8 per request"
    assert sorted(d.cached.values()) == ([0] + [64] * 7 if cache else [0] * 8), "usage.cached_tokens"
    d.assert_no_leak()


def test_identical_prompts_in_one_round_are_prefilled_once() -> None:
    d = Driver(config(page_size=1, num_pages=4096))
    p = tokens(40, 1)
    for rid in range(6):
        d.submit(rid, p, 3)
    d.run()
    assert all(d.tokens[rid] == reference_output(p, 3, [], 4096)[0] for rid in range(6))
    assert d.worker.extend_tokens - 6 * 2 == 40 + 5 * 1, "the others compute only the last prompt token"
    d.assert_no_leak()


def test_cache_salts_never_share() -> None:
    d = Driver(config(page_size=1, num_pages=4096))
    p = tokens(40, 2)
    d.submit(0, p, 2, salt="alice")
    d.run()
    d.submit(1, p, 2, salt="bob")
    d.submit(2, p, 2, salt="alice")
    d.run()
    assert d.cached == {0: 0, 1: 0, 2: 39}
    d.assert_no_leak()


def _lpm_run(max_overtakes: int) -> tuple[Driver, int | None]:
    """A cold 30-token prompt waits while two cached-prompt requests arrive each round (budget 30).

    Returns the driver and the admission round that took the cold one (None within 12 rounds).
    """
    d = Driver(config(page_size=1, schedule_policy="lpm", max_prefill_tokens=30, max_overtakes=max_overtakes))
    warm = tokens(40, 3)
    d.submit(0, warm + [1], 1)
    d.run()
    d.submit(1, tokens(30, 4), 1)  # arrived first, nothing cached
    rid = 2
    while d.sched.admission.num_rounds < 13:
        for _ in range(2):
            d.submit(rid, warm + [rid], 1)  # 40 of 41 tokens cached: 1 to compute
            rid += 1
        batch = d.step()
        assert batch is not None
        if 30 in batch.extend_lens:
            return d, d.sched.admission.num_rounds - 1  # the first round took request 0
        if 1 not in d.sched.reqs and batch.extend_lens:
            break
    return d, None


def test_lpm_takes_the_longest_cached_prefix_first_and_bounds_the_wait() -> None:
    d, round_taken = _lpm_run(max_overtakes=10_000)
    assert round_taken is None, "cached prompts keep filling the budget: the cold one waits"
    assert d.cached[2] == 40 and all(d.cached[r] == 40 for r in range(2, 8))
    d, round_taken = _lpm_run(max_overtakes=3)
    assert round_taken == 4, "overtaken 3 times, then it goes first"
    d.run()
    d.assert_no_leak()


@pytest.mark.parametrize("mixed", [False, True])
def test_outputs_identical_with_the_cache_on_and_off_under_eviction_and_retraction(mixed: bool) -> None:
    rng = random.Random(7)
    systems = [tokens(48, 10 + i) for i in range(3)]
    reqs = {
        rid: (rng.choice(systems) + tokens(rng.randint(1, 30), 50 + rid), rng.randint(5, 40))
        for rid in range(24)
    }

    def run(cache: bool) -> Driver:
        d = Driver(
            config(
                page_size=4,
                num_pages=48,  # 192 tokens: evicts cached prefixes and retracts running requests
                context_len=192,
                chunked_prefill_size=16,
                enable_mixed_chunk=mixed,
                disable_radix_cache=not cache,
                schedule_conservativeness=0.1,
            )
        )
        for rid, (p, max_new) in reqs.items():
            assert d.submit(rid, p, max_new, stop=[11]) is None
            if rid % 6 == 5:
                for _ in range(10):
                    d.step()
        d.run()
        d.assert_no_leak()
        return d

    on, off = run(True), run(False)
    assert on.tokens == off.tokens and on.finished == off.finished
    for rid, (p, max_new) in reqs.items():
        assert on.tokens[rid] == reference_output(p, max_new, [11], 192)[0]
    cache = on.sched.kv.cache
    assert cache is not None and cache.num_evicted_pages > 0, "the tiny pool must force eviction"
    assert on.sched.num_cached_prompt_tokens > 0 and on.worker.extend_tokens < off.worker.extend_tokens


def test_flush_frees_what_no_request_holds() -> None:
    d = Driver(config(page_size=4, num_pages=64))
    d.submit(0, tokens(40, 5), 2)
    d.run()
    assert d.sched.kv.evictable_pages == 10 and d.sched.kv.pages.num_free == 54
    d.submit(1, tokens(40, 5) + [3], 30)
    d.step()  # 1 holds the 10 cached pages locked
    assert d.sched.flush_cache() == 0, "locked pages stay"
    d.run()
    assert d.sched.flush_cache() > 0 and d.sched.kv.pages.num_free == 64
