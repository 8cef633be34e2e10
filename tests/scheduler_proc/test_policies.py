"""Admission policies and the prefill/decode knobs on the pure scheduler core: fcfs and pack
admission, --force-fifo-every, --max-overtakes, --prefill-max-requests, --max-running-requests,
--max-consecutive-prefills and --decode-first."""

from __future__ import annotations

import random

import pytest

from protocol.messages import FinishReason
from scheduler_proc.config import SchedulerConfig
from tests.scheduler_proc.harness import Driver, batch_kinds, fixed_ratio, reference_output


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def config(**overrides: object) -> SchedulerConfig:
    base: dict = dict(
        overlap_schedule=False, num_pages=4096, context_len=4096, page_size=1, chunked_prefill_size=-1
    )
    base.update(overrides)
    return SchedulerConfig(**base)


# ---------------------------------------------------------------- what fcfs and pack admit in one round


def test_pack_admits_the_short_ones_and_leaves_the_long_head() -> None:
    d = Driver(config(schedule_policy="pack", max_prefill_tokens=4))
    d.submit(0, prompt(100, 0), 2)
    d.submit(1, prompt(2, 1), 2)
    d.submit(2, prompt(2, 2), 2)
    batch = d.step()
    assert batch is not None and batch.extend_lens == [2, 2]
    assert [r.rid for r in d.sched.waiting] == [0], "the long one stays at the head"
    assert [r.rid for r in d.sched.running] == [1, 2], "admitted ones keep arrival order"
    d.run()
    assert d.finished.keys() == {0, 1, 2}
    d.assert_no_leak()


@pytest.mark.parametrize("policy", ["fcfs", "pack"])
def test_when_nothing_fits_the_head_goes_alone(policy: str) -> None:
    d = Driver(config(schedule_policy=policy, max_prefill_tokens=4))
    d.submit(0, prompt(100, 0), 2)
    d.submit(1, prompt(100, 1), 2)
    batch = d.step()
    assert batch is not None and batch.extend_lens == [100] and batch.req_pool_idx == [0]
    assert [r.rid for r in d.sched.waiting] == [1]


def test_fifo_stops_at_the_first_request_that_overflows_the_budget() -> None:
    d = Driver(config(max_prefill_tokens=4))
    for rid, n in enumerate([2, 100, 2]):
        d.submit(rid, prompt(n, rid), 2)
    batch = d.step()
    assert batch is not None and batch.extend_lens == [2], "100 overflows: the 2 behind it waits too"
    assert [r.rid for r in d.sched.waiting] == [1, 2]


def test_pack_keeps_the_skipped_in_queue_order_and_respects_the_lookahead() -> None:
    d = Driver(config(schedule_policy="pack", max_prefill_tokens=6, admission_lookahead=4))
    for rid, n in enumerate([50, 3, 40, 3, 2]):  # rid 4 (2 tokens) is beyond the window of 4
        d.submit(rid, prompt(n, rid), 2)
    batch = d.step()
    assert batch is not None and batch.extend_lens == [3, 3], "rids 1 and 3; rid 4 is not looked at"
    assert [r.rid for r in d.sched.waiting] == [0, 2, 4]


def _long_waits(d: Driver, rounds: int) -> int | None:
    """Two 2-token prompts arrive before every batch; the admission round that took rid 0, or None."""
    rid = 1
    for _ in range(4 * rounds):
        for _ in range(2):
            d.submit(rid, prompt(2, rid), 1)
            rid += 1
        batch = d.step()
        assert batch is not None
        if 100 in batch.extend_lens:
            return d.sched.admission.num_rounds
        if d.sched.admission.num_rounds >= rounds:
            return None
    return None


def test_force_fifo_every_brings_the_long_one_in_within_n_rounds() -> None:
    def run(force_fifo_every: int) -> int | None:
        d = Driver(
            config(
                schedule_policy="pack",
                max_prefill_tokens=4,
                force_fifo_every=force_fifo_every,
                max_overtakes=10_000,
            )
        )
        d.submit(0, prompt(100, 0), 1)
        return _long_waits(d, rounds=20)

    assert run(0) is None, "without force-fifo a stream of short prompts keeps the long one out"
    assert run(3) == 3


def test_max_overtakes_bounds_the_wait_under_pack() -> None:
    d = Driver(config(schedule_policy="pack", max_prefill_tokens=4, max_overtakes=5))
    d.submit(0, prompt(100, 0), 1)
    assert _long_waits(d, rounds=20) == 6, "overtaken in rounds 1-5, then it goes first"


# ---------------------------------------------------------------- KV head-of-line


def _kv_blocked(max_overtakes: int) -> Driver:
    """A pool of 100 tokens; A runs and reserves 60; the head H (40 + 10) does not fit, S (5 + 5) does."""
    d = Driver(config(num_pages=100, max_overtakes=max_overtakes, **fixed_ratio(1.0)))
    d.submit(0, prompt(10, 0), 60)
    d.step()
    d.submit(1, prompt(40, 1), 10)  # H
    d.submit(2, prompt(5, 2), 5)  # S
    return d


def test_a_head_that_does_not_fit_the_free_kv_lets_smaller_ones_by() -> None:
    d = _kv_blocked(max_overtakes=16)
    d.step()  # decode (A's prefill came last)
    batch = d.step()
    assert batch is not None and batch.extend_lens == [5], "S got in past H"
    assert [r.rid for r in d.sched.waiting] == [1] and d.sched.waiting[0].num_overtaken == 1
    d.run()
    assert d.finished == {0: FinishReason.LENGTH, 1: FinishReason.LENGTH, 2: FinishReason.LENGTH}
    d.assert_no_leak()


def test_an_overtaken_head_makes_everyone_wait_for_it() -> None:
    d = _kv_blocked(max_overtakes=0)
    while 0 in d.sched.reqs:
        d.step()
        assert [r.rid for r in d.sched.waiting] == [1, 2], "nobody passes H while A runs"
    d.run()
    order = [b.extend_lens for b in d.batches if b.sampler[0] is not None]
    assert order[1:] == [[40], [5]] or order[1:] == [[40, 5]], "H first, then S"
    d.assert_no_leak()


# ---------------------------------------------------------------- caps


def test_prefill_max_requests_caps_each_round() -> None:
    d = Driver(config(prefill_max_requests=2))
    for rid in range(5):
        d.submit(rid, prompt(3, rid), 4)
    d.run()
    prefills = [b for b in d.batches if any(s is not None for s in b.sampler)]
    assert [len(b.req_pool_idx) for b in prefills] == [2, 2, 1]
    d.assert_no_leak()


def test_max_running_requests_caps_unfinished_requests_and_full_rounds_only_decode() -> None:
    d = Driver(config(max_running_requests=2))
    for rid in range(5):
        d.submit(rid, prompt(3, rid), 4 + rid)
    while d.sched.has_work:
        d.step()
        assert len(d.sched.running) + (d.sched.chunked_req is not None) <= 2
    kinds = batch_kinds(d.batches)
    assert kinds[0] == "P" and kinds[1:4] == ["D", "D", "D"], "full: decode only until 0 finishes"
    for rid in range(5):
        assert d.tokens[rid] == reference_output(prompt(3, rid), 4 + rid, [], 4096)[0]
    d.assert_no_leak()


# ---------------------------------------------------------------- prefill vs decode


def _stream_of_prompts(**overrides: object) -> list[str]:
    """Two requests decode while 12 more prompts wait, each its own round (budget 8)."""
    d = Driver(config(max_prefill_tokens=8, **overrides))
    d.submit(0, prompt(8, 0), 40)
    d.submit(1, prompt(8, 1), 40)
    d.step()
    for rid in range(2, 14):
        d.submit(rid, prompt(8, rid), 20)
    for _ in range(16):
        d.step()
    d.run()
    d.assert_no_leak()
    return batch_kinds(d.batches)[1:17]


def test_consecutive_prefills_are_bounded_while_requests_wait_to_decode() -> None:
    assert _stream_of_prompts() == ["D", "P"] * 8, "default: a decode after every prefill"
    # The first batch (0 and 1's prefill) opened the streak.
    expected = ["P", "P", "D"] + ["P", "P", "P", "D"] * 3 + ["P"]
    assert _stream_of_prompts(max_consecutive_prefills=3) == expected


def test_decode_first_puts_a_decode_before_every_mixed_batch() -> None:
    assert _stream_of_prompts(enable_mixed_chunk=True)[:6] == ["M"] * 6
    assert _stream_of_prompts(enable_mixed_chunk=True, decode_first=True)[:6] == ["D", "M"] * 3
    assert _stream_of_prompts(max_consecutive_prefills=3, decode_first=True) == ["D", "P"] * 8
