"""Retraction: when decodes run out of KV, requests give theirs back and recompute later."""

from __future__ import annotations

import logging
import random

import pytest

from scheduler_proc.config import SchedulerConfig
from tests.scheduler_proc.harness import Driver, fixed_ratio, reference_output


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def run_all(config: SchedulerConfig, reqs: dict[int, tuple[list[int], int]]) -> Driver:
    d = Driver(config)
    for rid, (p, max_new) in reqs.items():
        assert d.submit(rid, p, max_new, stop=[11, 12]) is None
    d.run()
    d.assert_no_leak()
    return d


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("mixed", [False, True])
def test_retracted_requests_complete_with_the_same_tokens(page_size: int, mixed: bool) -> None:
    rng = random.Random(page_size)
    reqs = {rid: (prompt(rng.randint(5, 40), rid), rng.randint(20, 60)) for rid in range(10)}
    tiny = SchedulerConfig(
        num_pages=128 // page_size,
        context_len=256,
        page_size=page_size,
        chunked_prefill_size=32,
        enable_mixed_chunk=mixed,
        clip_max_new_tokens=4,  # reserve almost nothing: admission over-commits the pool
        **fixed_ratio(0.1),
    )
    big = SchedulerConfig(num_pages=4096, context_len=256, page_size=1, enable_mixed_chunk=mixed)
    small_run, big_run = run_all(tiny, reqs), run_all(big, reqs)
    assert small_run.sched.num_retracted > 0, "the tiny pool must force retraction"
    assert big_run.sched.num_retracted == 0
    assert small_run.tokens == big_run.tokens, "recompute changed the tokens (or duplicated rows)"
    assert small_run.finished == big_run.finished
    for rid, (p, max_new) in reqs.items():
        assert small_run.tokens[rid] == reference_output(p, max_new, [11, 12], 256)[0]


def _first_retracted(reqs: list[tuple[list[int], int, int]], caplog: pytest.LogCaptureFixture) -> int:
    """Runs (prompt, max_new, submit-at-step) requests in a 20-token pool; the first rid retracted."""
    cfg = SchedulerConfig(
        num_pages=20, context_len=64, page_size=1, clip_max_new_tokens=2, **fixed_ratio(0.01)
    )
    d = Driver(cfg)
    with caplog.at_level(logging.WARNING, logger="rivulet.scheduler"):
        for step in range(200):
            for rid, (p, max_new, at) in enumerate(reqs):
                if at == step:
                    d.submit(rid, p, max_new)
            if d.sched.num_retracted or (step > max(r[2] for r in reqs) and not d.sched.has_work):
                break
            d.step()
    assert d.sched.num_retracted == 1
    message = next(r.getMessage() for r in caplog.records if "retracted" in r.getMessage())
    d.run()
    d.assert_no_leak()
    return int(message.split("retracted rid ")[1].split()[0])


def test_retraction_victim_has_fewest_outputs_then_longest_prompt(caplog: pytest.LogCaptureFixture) -> None:
    # 0 starts first, so 1 has fewer output tokens when the pool runs dry.
    assert _first_retracted([(prompt(4, 0), 12, 0), (prompt(4, 1), 12, 3)], caplog) == 1
    caplog.clear()
    # Same start, same outputs: the longer prompt (rid 0) frees more.
    assert _first_retracted([(prompt(6, 0), 12, 0), (prompt(4, 1), 12, 0)], caplog) == 0
