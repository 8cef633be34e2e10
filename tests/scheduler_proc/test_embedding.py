"""Embedding requests in the scheduler: the pooled prompt comes back once, before the request's
end, through chunks and overlap; LAST may be served by the prefix cache, MEAN computes every
position. The fake worker's "hidden state" at a position is [token, 1.0]."""

from __future__ import annotations

import random

import pytest

from protocol.embedding import Pooling
from protocol.messages import FinishReason
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.embedding import EmbeddingState
from tests.scheduler_proc.harness import Driver, reference_output


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("mixed", [False, True], ids=["alternate", "mixed"])
def test_pooled_prompts_through_chunks_and_the_cache(overlap: bool, mixed: bool) -> None:
    config = SchedulerConfig(num_pages=256, context_len=512, page_size=4, chunked_prefill_size=5,
                             overlap_schedule=overlap, enable_mixed_chunk=mixed)  # fmt: skip
    d = Driver(config)
    shared = prompt(23, 0)
    d.submit(0, shared, 3)  # fills the prefix cache with ``shared``
    d.run()
    d.submit(1, shared, 0, pooling=Pooling.LAST)
    d.submit(2, shared, 0, pooling=Pooling.MEAN)
    d.submit(3, prompt(17, 3), 0, pooling=Pooling.MEAN)
    d.submit(4, prompt(1, 4), 0, pooling=Pooling.LAST)
    d.submit(5, prompt(30, 5), 6)  # decodes alongside
    d.run()
    assert d.embeddings[1] == [float(shared[-1]), 1.0]
    assert d.embeddings[2] == pytest.approx([sum(shared) / 23, 1.0])  # every position once
    assert d.embeddings[3] == pytest.approx([sum(prompt(17, 3)) / 17, 1.0])
    assert d.embeddings[4] == [float(prompt(1, 4)[0]), 1.0]
    assert d.cached[1] > 0 and d.cached[2] == 0, "only MEAN bypasses the prefix cache"
    for rid in (1, 2, 3, 4):
        assert d.finished[rid] is FinishReason.LENGTH and d.tokens[rid] == []
    assert 0 not in d.embeddings and 5 not in d.embeddings
    assert d.tokens[5] == reference_output(prompt(30, 5), 6, [], 512)[0]
    d.assert_no_leak()


def test_embedding_request_aborted_mid_prompt() -> None:
    d = Driver(SchedulerConfig(num_pages=256, context_len=512, page_size=4, chunked_prefill_size=5))
    d.submit(0, prompt(40, 0), 0, pooling=Pooling.MEAN)
    d.step()
    d.abort(0)
    d.run()
    assert d.finished[0] is FinishReason.ABORT and 0 not in d.embeddings
    d.assert_no_leak()


def test_state_asks_each_row_for_what_it_needs() -> None:
    last = EmbeddingState(Pooling.LAST, 10)
    assert [last.row_pool(0, 5), last.row_pool(5, 5)] == [None, Pooling.LAST]
    mean = EmbeddingState(Pooling.MEAN, 10)
    assert [mean.row_pool(0, 5), mean.row_pool(5, 5)] == [Pooling.MEAN, Pooling.MEAN]
    mean.add(0, 5, [1.0, 2.0])
    assert mean.take(7) is None
    mean.add(5, 5, [3.0, 4.0])
    taken = mean.take(7)
    assert (
        taken is not None
        and (taken.rid, taken.values) == (7, pytest.approx([0.4, 0.6]))
        and mean.take(7) is None
    )
    assert mean.row_pool(0, 10) is None  # done: a later row (never, for a prompt-only request) asks nothing
