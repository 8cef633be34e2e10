"""Overlap scheduling: the next batch is built while the worker runs the current one."""

from __future__ import annotations

from protocol.messages import PENDING, FinishReason, ForwardBatch
from tests.scheduler_proc.harness import Driver, reference_output
from tests.scheduler_proc.harness import random_prompt as prompt
from tests.scheduler_proc.harness import small_config as config


def decode_inputs(batch: ForwardBatch) -> list[int]:
    return [batch.input_ids[sum(batch.extend_lens[: i + 1]) - 1] for i in range(len(batch.req_pool_idx))]


def test_two_batches_in_flight_and_decode_inputs_are_pending_tokens() -> None:
    d = Driver(config())
    prompts = {rid: prompt(10 + rid, rid) for rid in range(3)}
    for rid, p in prompts.items():
        d.submit(rid, p, 12)
    d.step()  # the prefill, and already the first decode batch behind it
    assert len(d.pending) == 1 and len(d.batches) == 2, "a batch waits behind the one the worker runs"
    assert decode_inputs(d.batches[1]) == [PENDING] * 3, "their inputs are the tokens being drawn"
    d.run()
    for rid, p in prompts.items():
        assert d.tokens[rid] == reference_output(p, 12, [], 512)[0]
        assert d.finished[rid] is FinishReason.LENGTH
    d.assert_no_leak()


def test_no_row_after_the_last_token_a_length_limit_allows() -> None:
    d = Driver(config())
    d.submit(0, prompt(6, 0), 3)
    d.run()
    assert len(d.batches) == 3, "prefill + 2 decodes: nothing is scheduled past max_new_tokens"
    assert d.tokens[0] == reference_output(prompt(6, 0), 3, [], 512)[0]
    d.assert_no_leak()


def test_a_stop_token_costs_one_void_row_that_never_reaches_the_client() -> None:
    p = prompt(9, 5)
    full, _ = reference_output(p, 40, [], 512)
    stop = full[3]
    expected, reason = reference_output(p, 40, [stop], 512)
    assert reason is FinishReason.STOP
    d = Driver(config())
    d.submit(0, p, 40, stop=[stop])
    d.run()
    assert d.tokens[0] == expected and d.finished[0] is FinishReason.STOP
    assert len(d.batches) == len(expected) + 1, "one decode row was already in flight at the stop"
    d.assert_no_leak()


def test_a_failed_batch_fails_its_requests_and_the_one_behind_it_drops_their_rows() -> None:
    d = Driver(config())
    d.submit(0, prompt(8, 0), 20)
    d.submit(1, prompt(8, 1), 20)
    d.step()
    d.step()
    d.worker.fail_next = "boom"  # the batch sent next fails, with another behind it
    d.step()
    d.step()
    assert d.errors.keys() == {0, 1}
    d.submit(2, prompt(5, 2), 4)
    d.run()
    assert d.errors.keys() == {0, 1} and all("boom" in e for e in d.errors.values())
    assert d.tokens[2] == reference_output(prompt(5, 2), 4, [], 512)[0]
    d.assert_no_leak()


def test_retraction_waits_for_the_batch_in_flight_and_outputs_stay_exact() -> None:
    cfg = config(num_pages=24, page_size=4, schedule_conservativeness=0.15, new_token_ratio_decay_steps=0)
    d = Driver(cfg)
    prompts = {rid: prompt(12, 40 + rid) for rid in range(4)}
    for rid, p in prompts.items():
        d.submit(rid, p, 20)
    d.run()
    assert d.sched.num_retracted > 0, "the pool is too small for all four: someone is retracted"
    for rid, p in prompts.items():
        assert d.tokens[rid] == reference_output(p, 20, [], 512)[0]
    d.assert_no_leak()


def test_abort_with_two_batches_in_flight_frees_once_both_return() -> None:
    d = Driver(config())
    d.submit(0, prompt(8, 0), 30)
    d.submit(1, prompt(8, 1), 30)
    for _ in range(3):
        d.step()
    d.step(in_flight_hook=lambda _: d.abort(0))
    assert d.finished[0] is FinishReason.ABORT
    n = len(d.tokens[0])
    d.run()
    assert len(d.tokens[0]) == n, "no token after the abort"
    assert d.tokens[1] == reference_output(prompt(8, 1), 30, [], 512)[0]
    d.assert_no_leak()
