"""Speculative decoding in the scheduler core: the n-gram lookup, when drafting pauses, and verify
rows against the fake worker (which keeps a verify row's drafts up to the first that differs from
what it would have drawn there): the same tokens as without drafts, KV rolled back, no page leaked,
drafts within max_new_tokens, the context, the spare pages and half the input budget, and the overlap
schedule waiting only for requests that draft."""

from __future__ import annotations

import random
from typing import Any

import pytest

from protocol.messages import FinishReason
from scheduler_proc.scheduler import Scheduler
from scheduler_proc.speculative import (
    FIRST_PAUSE_STEPS,
    NO_DRAFT_LIMIT,
    DraftState,
    DraftTotals,
    NgramIndex,
    acceptance_floor,
    first_draft_length,
)
from tests.scheduler_proc.harness import VOCAB, Driver, random_prompt, reference_output, small_config

SPECULATE: dict[str, Any] = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4}


def test_lookup_drafts_the_continuation_of_the_latest_longest_match() -> None:
    index = NgramIndex(2, 3)
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    # "1 2 3" (3 tokens) last occurred at 0..2: its continuation 4, 9, 2, ... beats "2 3" at 5..6 (-> 5).
    assert index.draft(3) == [4, 9, 2]
    index.extend([7])
    assert index.draft(2) == []  # "3 7", "2 3 7" never occurred before
    index.extend([2, 3])
    assert index.draft(2) == [7, 2]  # "2 3" last at 10..11, followed by 7
    assert index.draft(0) == []


def test_a_match_at_the_end_repeats_its_period() -> None:
    index = NgramIndex(2, 2)
    index.extend([5, 6, 5, 6])
    assert index.draft(5) == [5, 6, 5, 6, 5]  # read through the draft itself


def test_the_sequence_never_matches_itself() -> None:
    index = NgramIndex(1, 4)
    index.extend([1, 2, 3])
    assert index.draft(4) == []


def test_drafting_pauses_after_lookups_that_find_nothing() -> None:
    state = DraftState(NgramIndex(2, 2))
    for i in range(NO_DRAFT_LIMIT):
        assert state.drafting
        assert state.propose([100 + i], 4) == []
    assert not state.drafting and state.pause_steps == FIRST_PAUSE_STEPS
    for _ in range(FIRST_PAUSE_STEPS):
        state.on_decode_step()
    assert state.drafting


def test_low_acceptance_pauses_longer_each_time_and_a_paying_draft_resets_it() -> None:
    state = DraftState(NgramIndex(2, 2))
    floor = acceptance_floor(1, 0.25)  # 0.2
    state.on_verified(4, 3, floor)
    assert state.drafting
    pauses: list[int] = []
    for _ in range(3):
        while state.drafting:
            state.on_verified(4, 0, floor)
        pauses.append(state.pause_steps)
        state.pause_steps = 0
    assert pauses == [FIRST_PAUSE_STEPS, 2 * FIRST_PAUSE_STEPS, 4 * FIRST_PAUSE_STEPS]
    state.on_verified(4, 4, floor)
    while state.drafting:
        state.on_verified(4, 0, floor)
    assert state.pause_steps == FIRST_PAUSE_STEPS


def test_the_draft_grows_after_a_verify_that_kept_all_and_shrinks_after_one_that_did_not() -> None:
    state = DraftState(NgramIndex(1, 2))
    first = state.propose(list(range(20)) * 3, 7, first_length=first_draft_length(7, 1, 0.25))
    assert len(first) == 7  # one stream: all it may
    lengths = []
    for drafted, accepted in [(7, 2), (6, 6), (7, 7), (7, 4), (6, 0), (5, 0), (4, 0), (3, 0), (2, 0), (1, 0)]:
        state.on_verified(drafted, accepted, floor=0.0)
        lengths.append(len(state.propose([], 7)))
    assert lengths == [
        6,
        7,
        7,
        6,
        5,
        4,
        3,
        2,
        1,
        1,
    ]  # +2 after all kept (at most K), -1 otherwise (at least 1)
    assert [first_draft_length(7, rows, 0.25) for rows in (1, 2, 4, 32)] == [7, 6, 4, 1]


def test_the_floor_grows_with_the_batch() -> None:
    floors = [acceptance_floor(rows, 0.25) for rows in (1, 4, 32)]
    assert floors == sorted(floors) and floors[0] == pytest.approx(0.2) and floors[-1] > 0.88
    # skipping every other batch, 3 drafts must keep more than one a verify: 1/3, over 4 rows' 0.5
    assert acceptance_floor(2, 0.25, 3, skips=True) == pytest.approx(1 / 3)
    assert acceptance_floor(4, 0.25, 3, skips=True) == acceptance_floor(4, 0.25) == pytest.approx(0.5)


class OracleDraft(DraftState):
    """Drafts the fake worker's own continuation (reference_output), one token in three wrong."""

    def __init__(self, prompt: list[int], reference: list[int], seed: int) -> None:
        super().__init__(NgramIndex(1, 1))
        self.prompt_len, self.reference = len(prompt), reference
        self.rng = random.Random(seed)

    def propose(self, new_tokens: list[int], max_tokens: int, first_length: int | None = None) -> list[int]:
        self.index.tokens.extend(new_tokens)
        done = len(self.index.tokens) - self.prompt_len
        draft = list(self.reference[done : done + max_tokens])
        for i in range(len(draft)):
            if self.rng.random() < 0.15:
                draft[i] = (draft[i] + 1) % 1000
        return draft

    def on_verified(self, drafted: int, accepted: int, floor: float) -> None:
        self.num_drafted += drafted
        self.num_accepted += accepted


def serve(driver: Driver, requests: list[tuple[list[int], int]], oracle: bool = True) -> None:
    """Submit (prompt, max_new) requests, give them oracle drafts, run to the end; every output is
    the fake worker's reference."""
    config = driver.config
    for rid, (prompt, max_new) in enumerate(requests):
        assert driver.submit(rid, prompt, max_new, stop=[7]) is None
        req = driver.sched.reqs[rid]
        ref, _ = reference_output(prompt, max_new, [7], config.context_len)
        if oracle:
            assert (req.draft is not None) == (max_new > 1), "a request that may draft drafts"
            req.draft = OracleDraft(prompt, ref, rid) if max_new > 1 else None
    driver.run()
    for rid, (prompt, max_new) in enumerate(requests):
        assert driver.tokens[rid] == reference_output(prompt, max_new, [7], config.context_len)[0], rid
    driver.assert_no_leak()


def workload(seed: int, n: int = 12) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [(random_prompt(rng.randint(1, 90), seed * 100 + i), rng.randint(1, 40)) for i in range(n)]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "alternate"])
def test_verify_rows_give_the_tokens_decoding_gives(overlap: bool, mixed: bool) -> None:
    driver = Driver(small_config(overlap_schedule=overlap, enable_mixed_chunk=mixed, **SPECULATE))
    serve(driver, workload(1))
    sched = driver.sched
    assert sched.num_draft_tokens > 0 and 0 < sched.num_accepted_tokens < sched.num_draft_tokens
    verify = [b for b in driver.batches if any(b.draft_lens)]
    assert verify and all(max(b.draft_lens) <= 4 for b in verify)


def test_a_small_pool_retracts_and_drafts_only_into_spare_pages() -> None:
    """Retraction under drafting: drafts never take the pages a decode needs, and every verify row's
    pages past what it kept are freed (check_invariants: a page table fits kv_len after each step)."""
    driver = Driver(small_config(num_pages=40, schedule_conservativeness=0.05, **SPECULATE))
    serve(driver, workload(2, n=10))
    assert driver.sched.num_retracted > 0 and driver.sched.num_draft_tokens > 0


def test_drafts_stay_within_max_new_tokens_and_the_context() -> None:
    config = small_config(context_len=64, **SPECULATE)
    driver = Driver(config)
    serve(driver, [(random_prompt(50, 3), 14), (random_prompt(10, 4), 5), (random_prompt(20, 5), 9)])
    for batch in driver.batches:
        for i, d in enumerate(batch.draft_lens):
            assert batch.prefix_lens[i] + batch.extend_lens[i] <= config.context_len
            assert d <= 4
    assert len(driver.tokens[1]) <= 5 and len(driver.tokens[2]) <= 9


def test_drafts_take_at_most_half_the_input_budget_and_the_rest_goes_to_prefill() -> None:
    driver = Driver(small_config(max_prefill_tokens=24, chunked_prefill_size=64, **SPECULATE))
    serve(driver, workload(5, n=16))
    for batch in driver.batches:
        drafted = sum(batch.draft_lens) if batch.draft_lens else 0
        assert drafted <= 12
        prefill = sum(n for n, s in zip(batch.extend_lens, batch.sampler, strict=True) if s is not None)
        assert drafted == 0 or prefill <= 24 - drafted or prefill == max(batch.extend_lens)


def test_a_drafting_request_skips_the_batch_built_while_its_row_flies_and_the_others_stay_overlapped() -> (
    None
):
    """Two requests, one drafting: while its verify row is in flight the next batch is built
    without it (the other's decode row rides on, overlapped), and it is back in the one after."""
    driver = Driver(small_config(**SPECULATE))
    serve_two = [(random_prompt(40, 11), 30), (random_prompt(40, 12), 30)]
    for rid, (prompt, max_new) in enumerate(serve_two):
        assert driver.submit(rid, prompt, max_new, stop=[7]) is None
    drafter = driver.sched.reqs[0]
    ref, _ = reference_output(serve_two[0][0], 30, [7], driver.config.context_len)
    drafter.draft = OracleDraft(serve_two[0][0], ref, 0)
    driver.sched.reqs[1].draft = None  # never drafts
    driver.run()
    verify_steps = [i for i, b in enumerate(driver.batches) if any(b.draft_lens)]
    assert len(verify_steps) > 3
    for i in verify_steps[:-1]:
        after = driver.batches[i + 1]
        assert len(after.req_pool_idx) == 1 and not any(after.draft_lens), "the other alone, overlapped"
    gaps = [b - a for a, b in zip(verify_steps, verify_steps[1:], strict=False)]
    assert max(gaps) <= 2, "it drafts every other batch"
    for rid, (prompt, max_new) in enumerate(serve_two):
        assert driver.tokens[rid] == reference_output(prompt, max_new, [7], driver.config.context_len)[0]
    driver.assert_no_leak()


def test_a_drafting_request_waits_for_its_result_and_overlap_resumes_once_drafting_pauses() -> None:
    """While a request drafts, no batch is built with one of its rows in flight (its draft needs its
    last token); a request whose lookups find nothing pauses, and two batches fly again."""
    driver = Driver(small_config(**SPECULATE))
    assert driver.submit(0, random_prompt(30, 9), 60) is None  # random tokens: no n-gram repeats
    states = []  # (it drafts as the step starts, batches still in flight after the step)
    while (req := driver.sched.reqs.get(0)) is not None:
        drafting = req.wants_draft and req.is_decoding
        driver.step()
        states.append((drafting, len(driver.pending)))
    assert any(drafting and left == 0 for drafting, left in states), "it waited while drafting"
    assert any(not drafting and left == 1 for drafting, left in states), "overlap once paused"
    driver.assert_no_leak()


def test_without_speculation_no_request_drafts() -> None:
    sched = Scheduler(small_config())
    driver = Driver(small_config())
    serve(driver, workload(7, n=4), oracle=False)
    assert sched.config.speculative is False and all(not b.draft_lens for b in driver.batches)


class TwoOfThree(DraftState):
    """Drafts the fake worker's next 3 tokens with the third wrong (none when fewer may go): every
    verify row keeps 2 drafts and draws the third token."""

    def __init__(self, prompt_len: int, reference: list[int]) -> None:
        super().__init__(NgramIndex(1, 1))
        self.prompt_len, self.reference = prompt_len, reference

    def propose(self, new_tokens: list[int], max_tokens: int, first_length: int | None = None) -> list[int]:
        self.index.tokens.extend(new_tokens)
        done = len(self.index.tokens) - self.prompt_len
        right = self.reference[done : done + 2]
        return [*right, (self.reference[done + 2] + 1) % VOCAB] if max_tokens >= 3 else []


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_drafts_accepted_and_verify_rows_are_counted_as_the_rows_come_back(overlap: bool) -> None:
    """11 tokens: the prompt's row draws 1, three verify rows 3 each (2 of 3 drafts kept), and the
    last, with no room for a draft (max_new_tokens), is a decode row."""
    driver = Driver(small_config(overlap_schedule=overlap, **SPECULATE))
    prompt = random_prompt(20, 8)
    ref, _ = reference_output(prompt, 11, [], driver.config.context_len)
    assert driver.submit(0, prompt, 11) is None
    state = driver.sched.reqs[0].draft = TwoOfThree(len(prompt), ref)
    driver.run()
    assert driver.tokens[0] == ref
    totals = driver.sched.draft_totals
    assert totals == DraftTotals(drafted=9, accepted=6, verify_rows=3)
    assert (state.num_drafted, state.num_accepted, state.num_verifies) == (9, 6, 3)
    assert totals.acceptance_rate == pytest.approx(2 / 3) and totals.accept_length == 3.0
    assert totals - DraftTotals(3, 2, 1) == DraftTotals(6, 4, 2) and DraftTotals().accept_length == 0.0


def test_a_verify_row_whose_request_ended_while_it_was_out_counts_nothing() -> None:
    driver = Driver(small_config(**SPECULATE))
    prompt = random_prompt(20, 9)
    ref, _ = reference_output(prompt, 11, [], driver.config.context_len)
    assert driver.submit(0, prompt, 11) is None
    driver.sched.reqs[0].draft = TwoOfThree(len(prompt), ref)
    driver.step()  # the prompt's row
    driver.step(in_flight_hook=lambda batch: driver.abort(0) if batch.draft_lens else None)
    assert driver.batches[-1].draft_lens == [3] and driver.finished[0] is FinishReason.ABORT
    assert driver.sched.draft_totals == DraftTotals()
