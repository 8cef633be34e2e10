from __future__ import annotations

import logging

import pytest

from scheduler_proc.config import SchedulerConfig
from scheduler_proc.stats import SchedulerStats
from tests.scheduler_proc.harness import Driver, random_prompt, reference_output, small_config
from tests.scheduler_proc.test_speculative import SPECULATE, TwoOfThree


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_one_prefill_line_per_prefill_batch_and_a_decode_line_every_n(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = SchedulerConfig(
        num_pages=100, context_len=64, page_size=1, decode_log_interval=3, overlap_schedule=False
    )
    d, clock = Driver(cfg), FakeClock()
    stats = SchedulerStats(cfg.decode_log_interval, logging.getLogger("rivulet.scheduler"), clock)
    d.submit(0, [1, 2, 3, 4], 7)
    d.submit(1, [5, 6], 7)
    clock.now_s += 1000.0  # idle time before the first batch does not count
    worker_busy_s = 7.0  # the worker's counters: busy 0.4 s of every 0.5 s step from here on
    with caplog.at_level(logging.INFO, logger="rivulet.scheduler"):
        while d.sched.has_work:
            clock.now_s += 0.5
            d.step(in_flight_hook=lambda _: stats.on_batch(d.sched))  # as the process: before the result
            worker_busy_s += 0.4
            stats.on_worker_result(worker_busy_s, clock.now_s + 50.0)  # its clock need not match ours
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == (
        "Prefill batch. #new-seq: 2, #new-token: 6, #cached-token: 0, cache hit rate: 0.0%, "
        "token usage: 0.06, #running-req: 0, #queue-req: 0"
    )
    decode_lines = [line for line in lines if line.startswith("Decode batch.")]
    assert len(lines) == 1 + len(decode_lines) and len(decode_lines) == 2, "6 decode steps, one line per 3"
    # The window opens at the prefill batch: 2 + 2 x 2 tokens sampled in the 1.5 s since.
    assert decode_lines[0] == (
        "Decode batch. #running-req: 2, #token: 12, token usage: 0.12, "
        "gen throughput (token/s): 4.00, worker busy: 80.0%, #queue-req: 0"
    )
    assert "gen throughput (token/s): 4.00, worker busy: 80.0%" in decode_lines[1], (
        "3 steps x 2 tokens in 1.5 s"
    )
    stats.on_idle(d.sched)
    clock.now_s += 1000.0
    d.submit(2, [7], 4)
    before = len(caplog.records)
    with caplog.at_level(logging.INFO, logger="rivulet.scheduler"):
        d.step(in_flight_hook=lambda _: stats.on_batch(d.sched))
        stats.on_worker_result(worker_busy_s + 0.1, clock.now_s + 1050.0)
        for _ in range(3):
            clock.now_s += 0.25
            d.step(in_flight_hook=lambda _: stats.on_batch(d.sched))
            worker_busy_s += 0.1
            stats.on_worker_result(worker_busy_s + 0.1, clock.now_s + 1050.0)
    assert len(caplog.records) == before + 2, "a prefill line and one decode line"
    # 1 + 2 tokens in 0.75 s, worker busy 0.1 of every 0.25 s: the 1000 s of idleness are in neither.
    assert "gen throughput (token/s): 4.00, worker busy: 40.0%" in caplog.records[-1].getMessage()


def run_logged(d: Driver, stats: SchedulerStats) -> None:
    while d.sched.has_work:
        d.step(in_flight_hook=lambda _: stats.on_batch(d.sched))


def test_speculation_shows_in_the_decode_line_and_once_more_when_idle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """TwoOfThree keeps 2 of every 3 drafts: 3 verify rows, then a decode row; a line every 3 decode
    batches, each logged as its batch is sent (its result not yet in)."""
    d = Driver(small_config(overlap_schedule=False, **SPECULATE))
    stats = SchedulerStats(3, logging.getLogger("rivulet.scheduler"), FakeClock())
    prompt = random_prompt(20, 8)
    ref, _ = reference_output(prompt, 11, [], d.config.context_len)
    d.submit(0, prompt, 11)
    d.sched.reqs[0].draft = TwoOfThree(len(prompt), ref)
    with caplog.at_level(logging.INFO, logger="rivulet.scheduler"):
        run_logged(d, stats)
        stats.on_idle(d.sched)
        stats.on_idle(d.sched)  # nothing verified since: no line
        d.submit(1, random_prompt(5, 9), 6)
        d.sched.reqs[1].draft = None  # decode rows only: a window with no verify row
        run_logged(d, stats)
    lines = [r.getMessage() for r in caplog.records if not r.getMessage().startswith("Prefill")]
    drafts = (
        "Speculative decoding. #drafted-token: {}, #accepted-token: {}, #verify-row: {}, "
        "accept rate: 66.7%, accept len: 3.00"
    )
    assert [line.split("#queue-req: 0")[-1] for line in lines] == [
        ", accept len: 3.00",  # the first two verify rows back, the third in flight
        drafts.format(6, 4, 2),
        drafts.format(9, 6, 3),  # idle
        ", accept len: 3.00",  # the third
        drafts.format(9, 6, 3),
        ", accept len: -",
        drafts.format(9, 6, 3),
    ]
