"""n > 1: the choices of a request fork from one prefill of its prompt (ReqStatus.FORKING)."""

from __future__ import annotations

import pytest

from protocol.messages import FinishReason
from scheduler_proc.request import ReqStatus
from tests.scheduler_proc.harness import Driver, reference_output
from tests.scheduler_proc.harness import random_prompt as prompt
from tests.scheduler_proc.harness import small_config as config


def decode_tokens(outputs: dict[int, list[int]]) -> int:
    """Tokens that decode rows computed: every output token but the last has its KV written."""
    return sum(len(out) - 1 for out in outputs.values())


@pytest.mark.parametrize("cache", [True, False], ids=["radix-cache", "no-cache"])
@pytest.mark.parametrize("prompt_len", [10, 12, 150], ids=["partial-page", "full-pages", "chunked"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_each_choice_equals_its_reference_and_the_prompt_is_computed_once(
    cache: bool, prompt_len: int, overlap: bool
) -> None:
    p, n, max_new = prompt(prompt_len, 1), 4, 9
    d = Driver(config(disable_radix_cache=not cache, overlap_schedule=overlap))
    assert d.submit(0, p, max_new, n=n) is None
    d.run()
    for choice in range(n):
        assert (d.tokens[choice], d.finished[choice]) == (
            reference_output(p, max_new, [], 512, choice)[0],
            FinishReason.LENGTH,
        )
    assert len({tuple(d.tokens[c]) for c in range(n)}) == n, "the choices drew different first tokens"
    # Prompt once, then one decode token per output but the last (no stop: overlap adds no void row).
    assert d.worker.extend_tokens == prompt_len + decode_tokens({c: d.tokens[c] for c in range(n)})
    forked = [b for b in d.batches if b.fork_req_pool_idx]
    assert len(forked) == 1 and len(forked[0].fork_req_pool_idx) == n - 1, "one batch draws every fork"
    copies = len(forked[0].copy_src)
    pages = -(-prompt_len // 4)
    assert copies == (n - 1) * (pages if not cache else int(prompt_len % 4 != 0)), "pages copied"
    d.assert_no_leak()


def test_choices_share_the_prompt_pages_through_the_cache() -> None:
    p = prompt(10, 2)
    d = Driver(config(overlap_schedule=False))
    d.submit(0, p, 20, n=3)
    d.step()  # the prefill draws every choice's first token
    d.step()  # and every choice decodes
    leader, forks = d.sched.reqs[0], [d.sched.reqs[1], d.sched.reqs[2]]
    for fork in forks:
        assert fork.status is ReqStatus.RUNNING and fork.page_table[:2] == leader.page_table[:2]
        assert fork.num_tree_pages == 2 and fork.page_table[2] != leader.page_table[2], "last page copied"
    assert d.sched.num_prompt_tokens == 10, "the prompt counts once"
    d.run()
    d.assert_no_leak()


def test_a_choice_may_end_with_its_first_token() -> None:
    p = prompt(10, 3)
    firsts = [reference_output(p, 5, [], 512, c)[0][0] for c in range(3)]
    d = Driver(config())
    d.submit(0, p, 5, stop=[firsts[1]], n=3)
    d.run()
    assert d.tokens[1] == [firsts[1]] and d.finished[1] is FinishReason.STOP
    for c in (0, 2):
        assert d.tokens[c] == reference_output(p, 5, [firsts[1]], 512, c)[0]
    d.assert_no_leak()


def test_aborting_the_leader_before_its_prompt_lands_ends_every_choice() -> None:
    d = Driver(config(chunked_prefill_size=8))
    d.submit(0, prompt(40, 4), 10, n=3)
    d.step()  # the first chunk: the choices hold req_pool_idx and pages, waiting to fork
    assert d.sched.reqs[1].status is ReqStatus.FORKING and d.sched.reqs[1].req_pool_idx is not None
    d.abort(0)
    assert d.finished == {0: FinishReason.ABORT, 1: FinishReason.ABORT, 2: FinishReason.ABORT}
    d.run()
    d.assert_no_leak()


def test_aborting_one_choice_while_the_fork_is_in_flight_leaves_the_others() -> None:
    p = prompt(10, 5)
    d = Driver(config())
    d.submit(0, p, 6, n=3)
    d.step(in_flight_hook=lambda batch: d.abort(1) if batch.fork_req_pool_idx else None)
    d.run()
    assert d.finished[1] is FinishReason.ABORT and d.tokens[1] == []
    for c in (0, 2):
        assert d.tokens[c] == reference_output(p, 6, [], 512, c)[0]
    d.assert_no_leak()


def test_a_failed_prefill_fails_every_choice() -> None:
    d = Driver(config())
    d.submit(0, prompt(10, 6), 6, n=3)
    d.worker.fail_next = "boom"
    d.run()
    assert set(d.errors) == {0, 1, 2} and all("boom" in e for e in d.errors.values())
    d.assert_no_leak()


def test_choices_survive_retraction() -> None:
    """A pool too small for every choice to run to its end: some are retracted and recomputed."""
    cfg = config(num_pages=40, overlap_schedule=False, **{"schedule_conservativeness": 0.1})
    d = Driver(cfg)
    prompts = {rid: prompt(10, rid) for rid in (0, 3)}
    for rid, p in prompts.items():
        assert d.submit(rid, p, 30, n=3) is None
    d.run()
    assert d.sched.num_retracted > 0, "the test needs retraction"
    for rid, p in prompts.items():
        for c in range(3):
            assert d.tokens[rid + c] == reference_output(p, 30, [], 512, c)[0]
    d.assert_no_leak()


def test_choices_that_could_never_fit_together_are_rejected() -> None:
    d = Driver(config(num_pages=16, max_running_requests=4))
    assert "max_running_requests" in str(d.submit(0, prompt(10, 7), 4, n=5))
    error = d.submit(10, prompt(10, 7), 30, n=4)
    assert error is not None and "n = 4 choices" in error.message
    assert d.submit(20, prompt(10, 7), 4, n=2) is None
    assert "duplicate" in str(d.submit(19, prompt(4, 1), 4, n=2)), "choice 1 would be rid 20"
    d.run()
    d.assert_no_leak()
