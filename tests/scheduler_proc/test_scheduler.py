"""The Scheduler core against the fake worker: admission, batches, finishing, aborts, failures."""

from __future__ import annotations

import random

import pytest

from protocol.messages import FinishReason, ForwardResult, RequestError, TokenBatch
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.request import Req
from tests.scheduler_proc.harness import Driver, batch_kinds, reference_output, sampler, tokenized


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def config(**overrides: int | float | bool) -> SchedulerConfig:
    base: dict = dict(
        overlap_schedule=False, num_pages=256, context_len=512, page_size=16, chunked_prefill_size=64
    )
    base.update(overrides)
    return SchedulerConfig(**base)


# ---------------------------------------------------------------- add()


def test_add_rejects_requests_that_can_never_run_and_keeps_no_state() -> None:
    d = Driver(config(num_pages=8, page_size=16, context_len=200))  # pool: 128 tokens
    cases = {
        1: (prompt(150), 51, "context length"),  # 201 > 200
        2: (prompt(128), 1, "does not fit the KV pool"),  # 129 tokens of KV
        3: (prompt(100), 40, "more KV than the whole pool"),  # 140 > 128 tokens
        4: ([], 4, "empty prompt"),
        5: (prompt(4), -1, "max_new_tokens"),  # 0 is a prompt-only request (echo)
    }
    for rid, (p, max_new, why) in cases.items():
        error = d.submit(rid, p, max_new)
        assert isinstance(error, RequestError) and error.rid == rid and why in error.message
    assert not d.sched.has_work and not d.sched.reqs
    assert d.submit(9, prompt(100), 28) is None, "exactly the pool: accepted"
    dup = d.submit(9, prompt(3), 1)
    assert isinstance(dup, RequestError) and "duplicate" in dup.message
    d.run()
    assert len(d.tokens[9]) >= 1 and 9 in d.finished
    d.assert_no_leak()


# ---------------------------------------------------------------- finish reasons


def test_finish_on_stop_token_max_new_tokens_and_context_len() -> None:
    d = Driver(config(context_len=40))
    p_stop, p_len, p_ctx = prompt(20, 1), prompt(20, 2), prompt(30, 3)
    third = reference_output(p_stop, 10, [], 40)[0][2]
    d.submit(1, p_stop, 10, stop=[third])
    d.submit(2, p_len, 5)
    d.submit(3, p_ctx, 10)  # 30 + 10 == context_len: allowed, ends exactly at it
    d.run()
    assert d.finished == {1: FinishReason.STOP, 2: FinishReason.LENGTH, 3: FinishReason.LENGTH}
    assert d.tokens[1] == reference_output(p_stop, 10, [third], 40)[0] and d.tokens[1][-1] == third
    assert len(d.tokens[2]) == 5 and len(d.tokens[3]) == 10
    d.assert_no_leak()


def test_context_len_ends_a_request_before_max_new_tokens() -> None:
    req = Req(rid=1, input_ids=[5] * 8, max_new_tokens=100, stop_token_ids=frozenset({7}), sampler=sampler())
    req.output_ids.append(3)
    assert req.finish_reason_at(0, context_len=10) is None
    req.output_ids.append(4)
    assert req.finish_reason_at(1, context_len=10) is FinishReason.LENGTH
    req.output_ids.append(7)
    assert req.finish_reason_at(2, context_len=10) is FinishReason.STOP, "a stop token wins"


# ---------------------------------------------------------------- batch shapes


@pytest.mark.parametrize("mixed", [False, True])
def test_mixed_puts_all_decodes_beside_the_chunk_and_non_mixed_alternates(mixed: bool) -> None:
    d = Driver(config(enable_mixed_chunk=mixed))
    d.submit(0, prompt(8, 0), 30)
    d.submit(1, prompt(8, 1), 30)
    d.step()  # both prefilled in one batch
    d.submit(2, prompt(300, 2), 3)  # 5 chunks of 64 (last 44)
    for _ in range(6):
        d.step()
    if mixed:
        assert batch_kinds(d.batches)[1:6] == ["M"] * 5
        for b in d.batches[1:6]:
            assert sorted(b.req_pool_idx) == [0, 1, 2], "every running decode rides with the chunk"
    else:
        # After a prefill, a decode: the long prompt's chunks never starve 0 and 1.
        assert batch_kinds(d.batches)[1:7] == ["D", "P", "D", "P", "D", "P"]
        assert all(sorted(b.req_pool_idx) == [0, 1] for b in d.batches[1:7:2])
    d.run()
    for rid, (n, seed, max_new) in {0: (8, 0, 30), 1: (8, 1, 30), 2: (300, 2, 3)}.items():
        assert d.tokens[rid] == reference_output(prompt(n, seed), max_new, [], 512)[0]
    d.assert_no_leak()


def test_one_token_batch_per_step_and_sampler_only_on_a_new_req_pool_idx() -> None:
    d = Driver(config())
    for rid in range(3):
        d.submit(rid, prompt(5, rid), 4)
    d.step()
    batch = d.batches[0]
    assert all(s is not None for s in batch.sampler) and batch.sampler[0] != batch.sampler[1]
    assert d.sched.take_outputs() == [], "nothing pending after collecting"
    d.step()
    assert d.batches[1].sampler == [None] * 3 and d.batches[1].extend_lens == [1, 1, 1]
    d.run()
    assert all(len(t) == 4 for t in d.tokens.values())
    d.assert_no_leak()


# ---------------------------------------------------------------- aborts and failures


@pytest.mark.parametrize("page_size", [1, 16])
def test_abort_in_every_state_frees_everything(page_size: int) -> None:
    d = Driver(config(page_size=page_size, num_pages=4096 // page_size, chunked_prefill_size=32))
    d.submit(0, prompt(8, 0), 50)  # will be running
    d.submit(1, prompt(200, 1), 5)  # will be chunked
    d.submit(2, prompt(8, 2), 5)  # stays waiting behind the chunked one
    d.submit(3, prompt(8, 3), 9)  # untouched: must finish normally
    d.step()
    d.step()  # 0 prefilled; 1 is the chunked_req; 2 and 3 wait
    assert d.sched.chunked_req is not None and d.sched.chunked_req.rid == 1
    d.abort(2)
    d.abort(1, FinishReason.STOP)
    d.abort(0)
    d.abort(12345)  # unknown: ignored
    assert d.finished == {2: FinishReason.ABORT, 1: FinishReason.STOP, 0: FinishReason.ABORT}
    d.run()
    assert d.tokens[3] == reference_output(prompt(8, 3), 9, [], 512)[0]
    assert d.tokens[2] == [] and d.tokens[1] == []
    d.assert_no_leak()


@pytest.mark.parametrize("victim", ["running", "chunked", "fresh"])
def test_abort_while_in_flight_drops_the_token_and_frees_on_the_result(victim: str) -> None:
    d = Driver(config(chunked_prefill_size=32))
    d.submit(0, prompt(8, 0), 20)
    d.submit(1, prompt(100, 1), 5)
    d.step()  # 0's prefill and 1's first chunk
    rid = {"running": 0, "chunked": 1, "fresh": 2}[victim]
    if victim == "fresh":
        d.submit(2, prompt(4, 2), 5)
    d.step(in_flight_hook=lambda batch: d.abort(rid))
    assert d.finished[rid] is FinishReason.ABORT
    tokens_at_abort = list(d.tokens[rid])
    d.run()
    assert d.tokens[rid] == tokens_at_abort, "no token after the abort row"
    d.assert_no_leak()


def test_worker_error_fails_that_batch_only() -> None:
    d = Driver(config(chunked_prefill_size=32))
    d.submit(0, prompt(8, 0), 20)
    d.step()  # 0's prefill
    d.submit(1, prompt(100, 1), 5)
    d.worker.fail_next = "CUDA error: out of memory"
    d.step()  # non-mixed: after a prefill comes a decode batch, only 0 in it
    assert d.errors.keys() == {0} and "out of memory" in d.errors[0]
    d.submit(2, prompt(5, 2), 3)
    d.worker.fail_next = "boom"
    d.step()  # 1's first chunk spends the chunk budget: 2 waits
    assert d.errors.keys() == {0, 1} and d.sched.chunked_req is None
    d.run()
    assert d.tokens[2] == reference_output(prompt(5, 2), 3, [], 512)[0], "the engine keeps serving"
    d.assert_no_leak()


def test_bad_results_are_survived() -> None:
    d = Driver(config())
    d.submit(0, prompt(8, 0), 5)
    batch = d.sched.schedule()
    assert batch is not None
    d.sched.on_result(ForwardResult(step=batch.step + 7, token_ids=[1], logprobs=[0.0], forward_s=0.0))
    assert d.sched.batch_in_flight, "a result for an unknown step is dropped"
    d.sched.on_result(ForwardResult(step=batch.step, token_ids=[1, 2], logprobs=[], forward_s=0.0))
    d.collect()
    assert "2 tokens for 1 sampled rows" in d.errors[0]
    d.assert_no_leak()


def test_abort_rows_and_tokens_share_one_token_batch() -> None:
    d = Driver(config())
    d.sched.add(tokenized(0, prompt(5, 0), 5))
    d.sched.add(tokenized(1, prompt(5, 1), 5))
    batch = d.sched.schedule()
    assert batch is not None
    d.sched.on_result(d.worker.run(batch))
    d.sched.abort(1, FinishReason.ABORT)
    outs = d.sched.take_outputs()
    assert len(outs) == 1 and isinstance(outs[0], TokenBatch)
    assert outs[0].rids == [0, 1, 1] and outs[0].token_ids[2] == -1
    assert outs[0].finished == [None, None, FinishReason.ABORT] and outs[0].cached_tokens == [0, 0, 0]
