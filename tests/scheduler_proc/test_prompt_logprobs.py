"""Prompt logprobs (echo) in the scheduler: every position asked for once, through chunks, past a
warm prefix cache; and prompt-only requests (max_new_tokens 0) that end after their prompt."""

from __future__ import annotations

import random

import pytest

from protocol.messages import FinishReason
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.request import why_rejected
from tests.scheduler_proc.harness import Driver, reference_output, tokenized


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def config(**overrides: object) -> SchedulerConfig:
    base: dict = dict(num_pages=256, context_len=512, page_size=4, chunked_prefill_size=5)
    base.update(overrides)
    return SchedulerConfig(**base)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("mixed", [False, True], ids=["alternate", "mixed"])
def test_every_prompt_position_once_even_when_the_prefix_is_cached(overlap: bool, mixed: bool) -> None:
    d = Driver(config(overlap_schedule=overlap, enable_mixed_chunk=mixed))
    shared = prompt(23, 0)
    d.submit(0, shared, 3)  # fills the prefix cache with ``shared``
    d.run()
    d.submit(1, shared, 2, prompt_logprobs=True)
    d.submit(2, prompt(17, 2), 4, prompt_logprobs=True)
    d.submit(3, prompt(1, 3), 2, prompt_logprobs=True)  # one token: no position to score
    d.submit(4, prompt(30, 4), 5)  # decodes alongside, asks for none
    d.run()
    d.submit(5, shared, 1)  # the cache still serves requests that want no prompt logprobs
    d.run()
    for rid, (p, max_new) in {1: (shared, 2), 2: (prompt(17, 2), 4), 3: (prompt(1, 3), 2)}.items():
        assert d.prompt_logprobs[rid] == [-float(t) for t in p[1:]], (
            f"rid {rid}: one logprob per prompt token"
        )
        assert d.tokens[rid] == reference_output(p, max_new, [], 512)[0]
    assert d.cached[1] == 0 and d.cached[5] > 0, "the prefix cache is bypassed only for prompt logprobs"
    assert 4 not in d.prompt_logprobs and 0 not in d.prompt_logprobs
    targets = sum(len(b.prompt_logprob_targets) for b in d.batches)
    assert targets == 22 + 16, "no position asked twice, none for the requests that did not ask"
    assert all(not b.prompt_logprob_lens for b in d.batches if not b.prompt_logprob_targets)
    d.assert_no_leak()


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("want_logprobs", [False, True])
def test_max_new_tokens_zero_ends_when_the_prompt_is_computed(overlap: bool, want_logprobs: bool) -> None:
    d = Driver(config(overlap_schedule=overlap, enable_mixed_chunk=True))
    d.submit(0, prompt(9, 0), 20)  # decoding while the prompt-only requests come and go
    d.step()
    d.submit(1, prompt(12, 1), 0, prompt_logprobs=want_logprobs)
    d.submit(2, prompt(3, 2), 0, prompt_logprobs=want_logprobs)
    d.run()
    for rid in (1, 2):
        assert d.finished[rid] is FinishReason.LENGTH and d.tokens[rid] == []
    assert d.tokens[0] == reference_output(prompt(9, 0), 20, [], 512)[0]
    assert (1 in d.prompt_logprobs) == want_logprobs
    sampled = sum(sum(b.sample) for b in d.batches)
    assert sampled == 20, "only request 0's rows draw tokens: a prompt-only request never does"
    d.assert_no_leak()


def test_prompt_only_request_aborted_mid_prompt_frees_everything() -> None:
    d = Driver(config())
    d.submit(0, prompt(40, 0), 0, prompt_logprobs=True)
    d.step()
    d.abort(0)
    d.run()
    assert d.finished[0] is FinishReason.ABORT and 0 not in d.prompt_logprobs
    d.assert_no_leak()


def test_max_new_tokens_may_be_zero_but_not_negative() -> None:
    cfg = config()
    assert why_rejected(tokenized(0, [1, 2], 0), cfg, duplicate=False) is None
    assert "max_new_tokens" in (why_rejected(tokenized(0, [1, 2], -1), cfg, duplicate=False) or "")
