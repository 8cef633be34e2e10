"""Many random requests under random configs and aborts: invariants every step, no leak at the end."""

from __future__ import annotations

import random

import pytest

from protocol.messages import FinishReason
from scheduler_proc.config import SchedulerConfig
from tests.scheduler_proc.harness import Driver, reference_output

STOP_IDS = (3, 5)


def random_config(rng: random.Random) -> SchedulerConfig:
    page_size = rng.choice([1, 2, 16])
    return SchedulerConfig(
        num_pages=rng.choice([256, 512, 2048]) // page_size,
        context_len=200,
        page_size=page_size,
        max_running_requests=rng.choice([2, 8, 64]),
        max_prefill_tokens=rng.choice([16, 100, 4096]),
        chunked_prefill_size=rng.choice([-1, 7, 32, 100]),
        enable_mixed_chunk=rng.random() < 0.5,
        clip_max_new_tokens=rng.choice([4, 4096]),
        schedule_conservativeness=rng.choice([0.15, 0.7, 1.5]),
        new_token_ratio_decay_steps=rng.choice([0, 20, 600]),
        schedule_policy=rng.choice(["fcfs", "pack"]),
        admission_lookahead=rng.choice([1, 4, 64]),
        force_fifo_every=rng.choice([0, 0, 3]),
        prefill_max_requests=rng.choice([0, 0, 1, 3]),
        max_overtakes=rng.choice([0, 2, 16]),
        decode_first=rng.random() < 0.3,
        max_consecutive_prefills=rng.choice([1, 1, 3]),
        disable_radix_cache=rng.random() < 0.25,
        overlap_schedule=rng.random() < 0.75,
    )


@pytest.mark.parametrize("seed", range(24))
def test_random_workload(seed: int) -> None:
    rng = random.Random(seed)
    cfg = random_config(rng)
    d = Driver(cfg)
    reqs: dict[int, tuple[list[int], int, int]] = {}  # rid -> (prompt, max_new, choice)
    aborted: set[int] = set()
    next_rid = 0
    shared = [[rng.randrange(1000) for _ in range(120)] for _ in range(3)]

    def abort_some(_batch: object) -> None:  # also called while a batch is in flight
        live = sorted(d.sched.reqs)
        if live and rng.random() < 0.015:
            rid = rng.choice(live)
            aborted.add(rid)
            aborted.update(fork.rid for fork in d.sched.reqs[rid].forks)  # choices not forked yet end too
            d.abort(rid)

    for _ in range(5000):
        if next_rid < 40 and rng.random() < 0.3:
            p = [rng.randrange(1000) for _ in range(rng.randint(1, 150))]
            if rng.random() < 0.5:  # many share a prefix: cache hits, in-batch dedup, eviction
                p = (shared[rng.randrange(3)] + p)[: len(p)]
            max_new = rng.randint(1, 200 - len(p))
            salt = rng.choice([None, None, "tenant"])
            n = rng.choice([1, 1, 1, 2, 3])  # n > 1: choices forking from one prefill
            if d.submit(next_rid, p, max_new, stop=STOP_IDS, salt=salt, n=n) is None:
                reqs.update({next_rid + i: (p, max_new, i) for i in range(n)})
            next_rid += n
        abort_some(None)
        if d.step(in_flight_hook=abort_some) is None:
            assert not d.sched.has_work, "stalled with work and nothing in flight"
            if next_rid >= 40:
                break
    assert next_rid >= 40 and not d.sched.has_work
    d.assert_no_leak()
    assert d.finished.keys() == reqs.keys() and not d.errors
    for rid, (p, max_new, choice) in reqs.items():
        expected, reason = reference_output(p, max_new, STOP_IDS, cfg.context_len, choice)
        if rid in aborted and d.finished[rid] is FinishReason.ABORT:
            assert d.tokens[rid] == expected[: len(d.tokens[rid])]
        else:
            assert (d.tokens[rid], d.finished[rid]) == (expected, reason)
