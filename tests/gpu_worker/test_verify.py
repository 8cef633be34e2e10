"""Verify rows in the worker (sampling/verify.py, sampling/draws.py): where a batch draws, which drafts
a row keeps, the states' view without drafts, and rejection sampling keeping the target distribution.

The statistical test draws a one-draft verify row for 6000 requests at once, each with its own seed:
the first token emitted (the draft when kept, else the replacement) must follow p at the first
position, and the token after a kept draft p at the second; chi-square at a fixed seed set, so the
test is deterministic (critical values at p = 0.001).
"""

from __future__ import annotations

import pytest
import torch

from gpu_worker.sampling.draws import BatchDraws
from gpu_worker.sampling.grammar import ReqPoolGrammars
from gpu_worker.sampling.logprobs import ReqPoolTopLogprobs
from gpu_worker.sampling.penalties import ReqPoolPenalties
from gpu_worker.sampling.sampler import ReqPoolSamplerParams
from gpu_worker.sampling.verify import DrawPlan, committed
from protocol.messages import ForwardBatch
from protocol.sampling import WorkerSampling

VOCAB = 6
CHI2_CRITICAL_5_DOF = 20.52  # p = 0.001


def batch(
    req_pool_idx: list[int], prefix_lens: list[int], inputs: list[list[int]], drafts: list[int]
) -> ForwardBatch:
    return ForwardBatch(
        step=1, req_pool_idx=req_pool_idx, prefix_lens=prefix_lens, extend_lens=[len(x) for x in inputs],
        input_ids=[t for x in inputs for t in x], page_starts=[0] * len(req_pool_idx),
        page_counts=[0] * len(req_pool_idx), pages=[], sample=[True] * len(req_pool_idx),
        sampler=[None] * len(req_pool_idx), draft_lens=drafts,
    )  # fmt: skip


def test_the_plan_draws_every_drafted_position_and_keeps_the_prefix_that_matches() -> None:
    b = batch([4, 7, 2], [10, 3, 0], [[5, 1, 2, 3], [9], [8, 8]], [3, 0, 1])
    plan = DrawPlan.of(b)
    assert plan.hidden_rows == [0, 1, 2, 3, 4, 5, 6]
    assert plan.req_pool_idx == [4, 4, 4, 4, 7, 2, 2]
    assert plan.positions == [11, 12, 13, 14, 4, 1, 2]  # the position of the token each draws
    assert plan.starts == [0, 4, 5] and plan.drafts == [[1, 2, 3], [], [8]]
    # row 0 keeps 1, 2 and draws 6 where 3 was drafted; row 2's draft 8 differs from its draw 4
    emitted, counts = plan.kept([1, 2, 6, 0, 9, 4, 5])
    assert emitted == [0, 1, 2, 4, 5] and counts == [3, 1, 1]
    emitted, counts = plan.kept([1, 2, 3, 7, 9, 8, 5])  # every draft kept: the bonus draw too
    assert emitted == [0, 1, 2, 3, 4, 5, 6] and counts == [4, 1, 2]


def test_the_states_see_no_draft_until_it_is_kept() -> None:
    b = batch([4, 7], [10, 3], [[5, 1, 2, 3], [9]], [3, 0])
    view, ids = committed(b, torch.tensor(b.input_ids))
    assert view.extend_lens == [1, 1] and view.input_ids == [5, 9] and ids.tolist() == [5, 9]
    assert not view.draft_lens
    plain = batch([4], [10], [[5]], [])
    assert committed(plain, torch.tensor([5]))[0] is plain


def draws(max_requests: int) -> tuple[BatchDraws, ReqPoolSamplerParams]:
    params = ReqPoolSamplerParams(max_requests)
    penalties = ReqPoolPenalties(max_requests, VOCAB, torch.device("cpu"), torch.float64)
    grammars = ReqPoolGrammars(max_requests, VOCAB, "", host_memory=True)
    return BatchDraws(
        params, ReqPoolTopLogprobs(max_requests), penalties, grammars, lambda x: x.max(-1).indices
    ), params


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    n = 6000
    draw, params = draws(n)
    samplers = [WorkerSampling(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed=s) for s in range(n)]
    params.update(list(range(n)), samplers)
    first = torch.tensor([1.0, 0.2, 1.6, -0.5, 0.9, 0.0], dtype=torch.float64)
    second = torch.tensor([0.3, 1.1, -1.0, 0.7, 0.0, 0.5], dtype=torch.float64)
    drafted = 2  # p(2) ~ 0.34: kept often, rejected often
    b = batch(list(range(n)), [20] * n, [[4, drafted]] * n, [1] * n)
    plan = DrawPlan.of(b)
    logits = torch.stack([first, second]).repeat(n, 1)
    out = draw.draw(logits, plan, b)
    tokens, counts = out.token_ids, out.num_tokens
    firsts, seconds, k = [], [], 0
    for c in counts:
        firsts.append(tokens[k])
        if c == 2:
            assert tokens[k] == drafted, "a row emits two tokens only when it kept its draft"
            seconds.append(tokens[k + 1])
        k += c
    first_counts = torch.bincount(torch.tensor(firsts), minlength=VOCAB).double()
    second_counts = torch.bincount(torch.tensor(seconds), minlength=VOCAB).double()
    assert chi_square(first_counts, torch.softmax(first, 0)) < CHI2_CRITICAL_5_DOF
    assert chi_square(second_counts, torch.softmax(second, 0)) < CHI2_CRITICAL_5_DOF
    kept = len(seconds) / n
    assert kept == pytest.approx(float(torch.softmax(first, 0)[drafted]), abs=0.03)


def test_a_seeded_draw_at_a_drafted_position_is_the_one_decoding_makes() -> None:
    """The noise is a function of (seed, position, token): the draw a verify row makes where its
    draft sits equals a plain decode row's at that position, kept or not."""
    draw, params = draws(2)
    params.update([0, 1], [WorkerSampling(temperature=0.8, top_k=-1, top_p=1.0, min_p=0.0, seed=3)] * 2)
    logits = torch.randn(3, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    verify = batch([0], [30], [[4, 1, 5]], [2])
    every = draw.draw(logits, DrawPlan.of(verify), verify)
    for j in range(3):  # a decode row at each position, alone
        plain = batch([1], [30 + j], [[4]], [])
        alone = draw.draw(logits[j : j + 1], DrawPlan.of(plain), plain).token_ids[0]
        if j < len(every.token_ids):
            assert every.token_ids[j] == alone
