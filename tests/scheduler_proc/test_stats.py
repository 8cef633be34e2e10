from __future__ import annotations

import logging

import pytest

from scheduler_proc.config import SchedulerConfig
from scheduler_proc.stats import SchedulerStats
from tests.scheduler_proc.harness import Driver


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
    stats.on_idle()
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
