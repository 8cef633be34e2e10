"""A request's flight (overlap state): rows are built, launched, then land, in order, or it fails loudly."""

from __future__ import annotations

import random

import pytest

from protocol.messages import PENDING, ForwardResult
from scheduler_proc.batch import build_forward_batch
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.request import Req
from scheduler_proc.scheduler import Scheduler
from tests.scheduler_proc.harness import Driver, FakeWorker, tokenized


def config(**overrides: object) -> SchedulerConfig:
    base: dict = dict(num_pages=256, context_len=512, page_size=4, chunked_prefill_size=16)
    base.update(overrides)
    return SchedulerConfig(**base)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def two_batches_in_flight() -> tuple[Scheduler, FakeWorker, list[ForwardResult]]:
    """Request 0 prefilled in step 0 and decoding in step 1, neither result back yet."""
    sched = Scheduler(config())
    worker = FakeWorker(sched.config)
    assert sched.add(tokenized(0, prompt(10, 0), 8)) is None
    results = [worker.run(batch) for batch in (sched.schedule(), sched.schedule()) if batch is not None]
    assert len(results) == 2
    return sched, worker, results


def live_reqs(sched: Scheduler) -> list[Req]:
    return list(sched.reqs.values())


def test_every_step_of_an_overlapped_run_keeps_each_flight_consistent() -> None:
    d = Driver(config())
    for rid in range(6):
        d.submit(rid, prompt(5 + 9 * rid, rid), 6 + rid, stop=[7])

    def check_all(_: object) -> None:  # with a batch still out: rows in flight, PENDING tokens
        for req in live_reqs(d.sched):
            req.flight.check(req)
            assert len(req.flight.rows) <= d.sched.max_in_flight

    while d.sched.has_work or d.pending:
        d.step(in_flight_hook=check_all)
        check_all(None)
    assert len(d.finished) == 6


def test_the_forward_batch_is_built_before_its_rows_launch() -> None:
    sched, _, _ = two_batches_in_flight()
    rows = sched._in_flight[1]
    with pytest.raises(AssertionError, match="built after launch"):
        build_forward_batch(1, rows, 4)  # kv_len has moved past the row: its inputs would be wrong


def test_a_row_launches_once() -> None:
    sched, _, _ = two_batches_in_flight()
    (row,) = sched._in_flight[1]
    with pytest.raises(AssertionError, match="launched twice"):
        row.req.flight.launch(row, sched.config.context_len)


def test_results_land_in_the_order_their_batches_were_sent() -> None:
    sched, _, _ = two_batches_in_flight()
    (late,) = sched._in_flight[1]
    with pytest.raises(AssertionError, match="out of send order"):
        late.req.flight.land(late, 5)


def test_a_drawn_token_overwritten_before_its_result_is_caught() -> None:
    sched, _, results = two_batches_in_flight()
    sched.on_result(results[0])
    req = sched.reqs[0]
    assert req.output_ids[-1] == PENDING and len(req.flight.rows) == 1
    req.output_ids[-1] = 3  # e.g. output_ids truncated or rewritten while a row still draws it
    with pytest.raises(AssertionError, match="a drawn token is lost"):
        req.flight.check(req)


def test_kv_cannot_be_reset_under_rows_in_flight() -> None:
    sched, _, _ = two_batches_in_flight()
    with pytest.raises(AssertionError, match="rows in flight"):
        sched.reqs[0].flight.reset()  # e.g. a retraction that did not wait for the batch out
