"""A request's flight (overlap state): rows are built, launched, then land, in order, or it fails loudly."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

import pytest

from protocol.messages import PENDING, ForwardResult
from scheduler_proc.batch import Row, build_forward_batch
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.flight import Flight
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


def reference_check(flight: Flight, req: Req) -> None:
    """Flight.check as it was written before its one-pass form (the invariants, built as lists)."""
    drafted = sum(len(row.draft) for row in flight.rows)
    assert 0 <= flight.computed_len <= flight.kv_len <= req.seq_len + drafted
    assert flight.worker_pages <= len(req.page_table)
    end = flight.computed_len
    for row in flight.rows:
        assert row.start == end
        end += row.extend_len
    assert end == flight.kv_len
    sampling = [row.out_index for row in flight.rows if row.sample]
    first = len(req.output_ids) - len(sampling)
    assert sampling == list(range(first, len(req.output_ids)))
    assert all(t == PENDING for t in req.output_ids[first:])
    assert first == 0 or req.output_ids[first - 1] != PENDING


def raises(check: Callable[[], None], errors: tuple[type[Exception], ...] = (AssertionError,)) -> bool:
    try:
        check()
    except errors:
        return True
    return False


def corruptions(req: Req) -> list[tuple[Callable[[], object], Callable[[], None]]]:
    """(break, restore) pairs, each a change to the request's flight or outputs some bug could make."""
    flight, out = req.flight, req.output_ids
    saved_out, saved = list(out), (flight.kv_len, flight.computed_len, flight.worker_pages)

    def restore() -> None:
        out[:] = saved_out
        flight.kv_len, flight.computed_len, flight.worker_pages = saved
        for row, (start, index, sample, draft) in zip(flight.rows, rows, strict=True):
            row.start, row.out_index, row.sample, row.draft = start, index, sample, draft

    rows = [(row.start, row.out_index, row.sample, row.draft) for row in flight.rows]
    cases: list[Callable[[], object]] = [
        lambda: out.append(PENDING),
        lambda: out.append(3),
        lambda: out.pop() if out else None,
        lambda: out.__setitem__(-1, 3) if out else None,
        lambda: out.__setitem__(-1, PENDING) if out else None,
        lambda: out.__setitem__(0, PENDING) if out else None,
        lambda: setattr(flight, "kv_len", flight.kv_len + 1),
        lambda: setattr(flight, "kv_len", flight.kv_len - 1),
        lambda: setattr(flight, "computed_len", flight.computed_len + 1),
        lambda: setattr(flight, "computed_len", -1),
        lambda: setattr(flight, "worker_pages", len(req.page_table) + 1),
    ]
    for i, row in enumerate(flight.rows):
        cases += row_corruptions(row, flight.rows[0].out_index if i else None)
    return [(case, restore) for case in cases]


def row_corruptions(row: Row, earlier_out_index: int | None) -> list[Callable[[], object]]:
    """Changes to one row in flight; ``earlier_out_index``: the first row's, for a later row."""
    cases: list[Callable[[], object]] = [
        lambda: setattr(row, "start", row.start + 1),
        lambda: setattr(row, "out_index", row.out_index + 1),
        lambda: setattr(row, "out_index", row.out_index - 1),
        lambda: setattr(row, "sample", not row.sample),
        lambda: setattr(row, "draft", [5, 6]),
    ]
    if earlier_out_index is not None:
        cases.append(lambda: setattr(row, "out_index", earlier_out_index))
    return cases


def test_the_one_pass_check_fails_exactly_where_the_invariants_written_out_fail() -> None:
    d = Driver(config())
    for rid in range(6):
        d.submit(rid, prompt(5 + 9 * rid, rid), 6 + rid, stop=[7])
    seen = {True: 0, False: 0}

    def compare(_: object) -> None:
        for req in live_reqs(d.sched):
            req.flight.check(req)
            for corrupt, restore in corruptions(req):
                corrupt()
                # the written-out form indexed past the outputs on a row drawing output -1
                expected = raises(
                    functools.partial(reference_check, req.flight, req), (AssertionError, IndexError)
                )
                assert raises(functools.partial(req.flight.check, req)) == expected
                seen[expected] += 1
                restore()
            req.flight.check(req)

    while d.sched.has_work or d.pending:
        d.step(in_flight_hook=compare)
    assert len(d.finished) == 6
    assert seen[True] > 100 and seen[False] > 10  # both outcomes were met many times
