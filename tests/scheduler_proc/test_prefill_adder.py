"""PrefillAdder budgets, alone and as the scheduler uses them round by round."""

from __future__ import annotations

import random
from collections import deque

from protocol.messages import ForwardBatch
from scheduler_proc.admission import Admission
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.prefill_adder import AddResult, PrefillAdder
from scheduler_proc.request import Req
from tests.scheduler_proc.harness import Driver, fixed_ratio, reference_output, sampler


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def req(rid: int, n: int, max_new: int = 8) -> Req:
    return Req(
        rid=rid,
        input_ids=prompt(n, rid),
        max_new_tokens=max_new,
        stop_token_ids=frozenset(),
        sampler=sampler(),
    )


def adder(**overrides: int | float | None) -> PrefillAdder:
    budget: dict = dict(
        page_size=1,
        clip_max_new_tokens=4096,
        rem_input_tokens=4096,
        rem_chunk_tokens=256,
        rem_total_tokens=100_000,
        available_pages=100_000,
        free_req_pool_idxs=8,
    )
    budget.update(overrides)
    return PrefillAdder(**budget)


def rows_of(batch: ForwardBatch) -> list[tuple[int, int, int, bool]]:
    """(req_pool_idx, prefix_len, extend_len, sample) per row."""
    return list(zip(batch.req_pool_idx, batch.prefix_lens, batch.extend_lens, batch.sample, strict=True))


def config(**overrides: int | float | bool) -> SchedulerConfig:
    base: dict = dict(
        overlap_schedule=False, num_pages=4096, context_len=4096, page_size=1, chunked_prefill_size=256
    )
    base.update(overrides)
    return SchedulerConfig(**base)


# ---------------------------------------------------------------- the adder alone


def test_adder_truncates_an_oversize_prompt_into_the_one_chunked_req() -> None:
    a = adder()
    long1, long2 = req(1, 1000), req(2, 1000)
    assert a.add_one_req(long1).result is AddResult.NO_BUDGET, "the chunk budget is spent"
    assert a.can_run_list == [(long1, 256)] and a.new_chunked_req is long1
    assert a.add_one_req(long2).result is AddResult.NO_BUDGET and len(a.can_run_list) == 1, (
        "never two chunked reqs"
    )


def test_adder_stops_when_input_budget_is_spent_but_admits_a_big_head_alone() -> None:
    a = adder(rem_input_tokens=100, rem_chunk_tokens=None)
    r1, r2, r3 = req(1, 40), req(2, 40), req(3, 40)
    assert a.add_one_req(r1).result is AddResult.CONTINUE
    assert a.add_one_req(r2).result is AddResult.CONTINUE
    assert a.add_one_req(r3).result is AddResult.NO_BUDGET
    assert [r for r, _ in a.can_run_list] == [r1, r2]
    alone = adder(rem_input_tokens=100, rem_chunk_tokens=None)
    alone.add_one_req(req(4, 150))
    assert [n for _, n in alone.can_run_list] == [150], "a prompt over the budget still runs, alone"


def test_adder_kv_reservation_and_req_pool() -> None:
    # 30 prompt + 20 reserved output = 50 tokens of KV needed.
    assert adder(rem_total_tokens=49).add_one_req(req(1, 30, max_new=20)).result is AddResult.NO_TOKEN
    assert adder(rem_total_tokens=50).add_one_req(req(1, 30, max_new=20)).result is AddResult.CONTINUE
    # clip_max_new_tokens caps the reservation.
    assert (
        adder(rem_total_tokens=40, clip_max_new_tokens=10).add_one_req(req(1, 30, 20)).result
        is AddResult.CONTINUE
    )
    # Pages are whole: 50 tokens on 16-token pages cost 64.
    assert adder(page_size=16, rem_total_tokens=63).add_one_req(req(1, 30, 20)).result is AddResult.NO_TOKEN
    a = adder(free_req_pool_idxs=1)
    assert a.add_one_req(req(1, 5)).result is AddResult.NO_REQ_POOL_IDX, (
        "admitted, and no req_pool_idx is left"
    )
    assert a.add_one_req(req(2, 5)).result is AddResult.NO_REQ_POOL_IDX and len(a.can_run_list) == 1


def test_add_one_req_says_whether_the_request_got_in_and_what_it_extends() -> None:
    a = adder(free_req_pool_idxs=1, rem_chunk_tokens=256)
    got = a.add_one_req(req(1, 1000))
    assert got.admitted and got.extend_len == 256, "admitted, truncated into the chunked_req"
    refused = a.add_one_req(req(2, 5))
    assert not refused.admitted and refused.extend_len == 0 and len(a.can_run_list) == 1
    assert not adder(rem_total_tokens=10).add_one_req(req(3, 30)).admitted


def test_a_refused_request_gives_its_cached_prefix_back_to_the_cache_and_the_budget() -> None:
    cfg = config(num_pages=300)
    d = Driver(cfg)
    shared = prompt(100)
    d.submit(0, shared, 2)
    d.run()  # its prompt pages stay cached, evictable
    kv = d.sched.kv
    evictable = kv.evictable_pages
    assert evictable > 0
    a = PrefillAdder.for_round(cfg, [], 1.0, kv.available_pages, kv.req_pool.num_free)
    budget = (a.available_pages, a.rem_total_tokens)
    big = Req(
        rid=1, input_ids=[*shared, 5, 6, 7], max_new_tokens=250, stop_token_ids=frozenset(), sampler=sampler()
    )  # its prefix hit leaves too little KV for its reservation: refused
    waiting = deque([big])
    assert Admission(cfg).admit(a, waiting, kv) == [] and list(waiting) == [big]
    assert not big.page_table and big.kv_len == 0 and big.cache_node is None, "kept its prefix"
    assert kv.evictable_pages == evictable, "its prefix stayed locked"
    assert (a.available_pages, a.rem_total_tokens) == budget, "the adder still counts its prefix as taken"
    kv.check_integrity([])


# ---------------------------------------------------------------- the scheduler's rounds


def test_oversize_prompt_runs_in_four_chunks_and_only_the_last_samples() -> None:
    d = Driver(config())
    p = prompt(1000)
    d.submit(0, p, 4)
    for _ in range(4):
        d.step()
    assert [rows_of(b)[0][1:] for b in d.batches] == [
        (0, 256, False),
        (256, 256, False),
        (512, 256, False),
        (768, 232, True),
    ]
    assert len(d.tokens[0]) == 1, "the last chunk drew the first token"
    assert [b.sampler[0] is not None for b in d.batches] == [True, False, False, False]
    d.run()
    assert d.tokens[0] == reference_output(p, 4, [], 4096)[0]
    d.assert_no_leak()


def test_chunked_req_is_continued_first_and_only_one_at_a_time() -> None:
    d = Driver(config())
    d.submit(0, prompt(600, 0), 2)
    d.step()  # A's first chunk
    d.submit(1, prompt(600, 1), 2)
    d.submit(2, prompt(10, 2), 2)
    d.step()  # A's second chunk took the whole chunk budget: nothing else joins
    assert [r[2] for r in rows_of(d.batches[1])] == [256]
    d.step()  # A's last 88 tokens first, then B truncated to what is left of the chunk
    rows = rows_of(d.batches[2])
    assert [(r[1], r[2], r[3]) for r in rows] == [(512, 88, True), (0, 168, False)]
    d.run()
    for b in d.batches:
        assert sum(not s for s in b.sample) <= 1, "two chunked requests in one batch"
    assert d.finished.keys() == {0, 1, 2}
    d.assert_no_leak()


def test_input_budget_exhaustion_stops_admission() -> None:
    d = Driver(config(max_prefill_tokens=100, chunked_prefill_size=-1))
    for rid in range(3):
        d.submit(rid, prompt(40, rid), 1)
    d.step()
    assert [r[2] for r in rows_of(d.batches[0])] == [40, 40], "the third would pass max_prefill_tokens"
    d.step()
    assert [r[2] for r in rows_of(d.batches[1])] == [40]
    d.assert_no_leak()


def test_chunking_disabled_admits_the_whole_prompt() -> None:
    d = Driver(config(chunked_prefill_size=-1))
    d.submit(0, prompt(1000), 2)
    d.step()
    assert rows_of(d.batches[0]) == [(0, 0, 1000, True)]
    d.run()
    d.assert_no_leak()


def _first_batch_of(d: Driver, prompt_len: int) -> int:
    """Index of the first batch with a fresh row (sampler sent) of prompt length ``prompt_len``."""
    for i, b in enumerate(d.batches):
        if any(s is not None and e == prompt_len for s, e in zip(b.sampler, b.extend_lens, strict=True)):
            return i
    raise AssertionError("never admitted")


def _reservation_run(new_token_ratio: float) -> Driver:
    # Pool of 100 tokens. A (10 + 50 output) runs; B needs 30 + 20 = 50 tokens.
    # A's reservation leaves 100 - 10 - 49 = 41 < 50 at ratio 1, so B must wait for A.
    d = Driver(config(num_pages=100, **fixed_ratio(new_token_ratio)))
    d.submit(0, prompt(10, 0), 50)
    d.step()
    d.submit(1, prompt(30, 1), 20)
    d.run()
    d.assert_no_leak()
    return d


def test_kv_reservation_holds_a_request_back_until_running_ones_finish() -> None:
    d = _reservation_run(1.0)
    # A runs alone: 1 prefill + 49 decodes, its 50th token ends it; B comes right after.
    assert all(len(b.req_pool_idx) == 1 for b in d.batches[:50])
    assert _first_batch_of(d, 30) == 50, "B admitted only once A finished"
    assert len(d.tokens[0]) == 50 and d.sched.num_retracted == 0
    # At ratio 0.5 A reserves 25 tokens: B fits at once and runs beside A.
    assert _first_batch_of(_reservation_run(0.5), 30) == 2
