"""The batched sampler: greedy, filters, and noise that depends only on (seed, position, token)."""

from __future__ import annotations

import torch

from gpu_worker.sampling.sampler import ReqPoolSamplerParams, sample
from protocol.sampling import WorkerSampling


def params(
    rows: list[WorkerSampling], positions: list[int] | None = None
) -> tuple[ReqPoolSamplerParams, list[int], list[int]]:
    table = ReqPoolSamplerParams(len(rows))
    req_pool_idx = list(range(len(rows)))
    table.update(req_pool_idx, list(rows))
    return table, req_pool_idx, positions if positions is not None else [10] * len(rows)


def draw(
    rows: list[WorkerSampling], logits: torch.Tensor, positions: list[int] | None = None
) -> torch.Tensor:
    table, req_pool_idx, pos = params(rows, positions)
    tokens, _ = sample(logits, table.batch(req_pool_idx, pos, torch.device("cpu")))
    return tokens


def sp(
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 0,
    logprobs: bool = True,
) -> WorkerSampling:
    return WorkerSampling(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, logprobs=logprobs
    )


def test_greedy_is_argmax_with_raw_logprobs() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    table, req_pool_idx, pos = params([sp(temperature=0.0, seed=i) for i in range(8)])
    tokens, logprobs = sample(logits, table.batch(req_pool_idx, pos, torch.device("cpu")))
    assert torch.equal(tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected)


def test_greedy_rows_mixed_with_sampled_rows_stay_greedy() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    rows = [sp(temperature=0.0 if i % 2 else 1.5, seed=i) for i in range(6)]
    tokens = draw(rows, logits)
    assert torch.equal(tokens[1::2], logits[1::2].argmax(-1))


def test_top_k_one_is_greedy() -> None:
    logits = torch.randn(64, 30, generator=torch.Generator().manual_seed(2))
    tokens = draw([sp(temperature=2.0, top_k=1, seed=i) for i in range(64)], logits)
    assert torch.equal(tokens, logits.argmax(-1))


def test_same_seed_and_position_give_same_token_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 100, generator=gen)
    rows = [sp(temperature=1.0, seed=1000 + i) for i in range(6)]
    positions = [7, 7, 8, 9, 100, 3]
    alone = [draw([rows[i]], logits[i : i + 1], [positions[i]]).item() for i in range(6)]
    together = draw(rows, logits, positions).tolist()
    order = [4, 2, 0, 5, 1, 3]
    shuffled = draw([rows[i] for i in order], logits[order], [positions[i] for i in order]).tolist()
    # A batch with other mates and filters elsewhere takes the filtered path for every row.
    mates = [sp(temperature=0.5, top_p=0.3, seed=7), rows[3], sp(temperature=0.0)]
    mixed = draw(mates, torch.stack([logits[0], logits[3], logits[5]]), [1, positions[3], 2]).tolist()
    assert together == alone
    assert shuffled == [alone[i] for i in order]
    assert mixed[1] == alone[3]


def test_different_seeds_and_positions_draw_differently() -> None:
    logits = torch.zeros(400, 20)  # uniform: every draw is the noise alone
    by_seed = draw([sp(seed=s) for s in range(400)], logits).tolist()
    by_position = draw([sp(seed=5)] * 400, logits, list(range(400))).tolist()
    assert len(set(by_seed)) == 20 and len(set(by_position)) == 20
    assert by_seed != by_position


def test_top_p_and_min_p_never_pick_a_removed_token() -> None:
    logits = torch.log(torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])).repeat(2000, 1)
    top_p = draw([sp(top_p=0.6, seed=s) for s in range(2000)], logits)
    assert set(top_p.tolist()) == {0, 1}  # 0.4 < 0.6 needs the second token; 0.65 >= 0.6 stops
    min_p = draw([sp(min_p=0.3, seed=s) for s in range(2000)], logits)
    assert set(min_p.tolist()) == {0, 1, 2}  # prob >= 0.3 * 0.4 = 0.12
    top_k = draw([sp(top_k=3, temperature=3.0, seed=s) for s in range(2000)], logits)
    assert set(top_k.tolist()) == {0, 1, 2}


def test_draws_follow_softmax_of_scaled_logits() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -2.0])
    temperature, n = 0.7, 20000
    tokens = draw([sp(temperature=temperature, seed=s) for s in range(n)], logits.repeat(n, 1))
    freq = torch.bincount(tokens, minlength=5).double() / n
    expected = torch.softmax(logits.double() / temperature, -1)
    assert (freq - expected).abs().max() < 0.015, (freq, expected)


def test_large_and_negative_seeds_are_accepted() -> None:
    logits = torch.zeros(3, 10)
    tokens = draw([sp(seed=-1), sp(seed=2**64 - 1), sp(seed=2**40 + 3)], logits)
    assert tokens[0] == tokens[1]  # -1 and 2**64 - 1 are the same 64-bit seed
    assert ((tokens >= 0) & (tokens < 10)).all()


def test_greedy_rows_without_logprobs_skip_them_and_pick_the_same_tokens() -> None:
    """No row asked for logprobs: the max over the bf16 logits themselves, no logprobs; the picks
    equal the float32 path's, ties included (the first maximal index)."""
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(4)).bfloat16()
    logits[3, 17] = logits[3, 250] = logits[3].max() + 1  # a tie: the first index wins
    plain, req_pool_idx, pos = params([sp(temperature=0.0, seed=i, logprobs=False) for i in range(8)])
    tokens, logprobs = sample(logits, plain.batch(req_pool_idx, pos, torch.device("cpu")))
    assert logprobs is None
    assert torch.equal(tokens, logits.float().argmax(-1)) and tokens[3] == 17
    one_asks = [sp(temperature=0.0, seed=i, logprobs=i == 0) for i in range(8)]
    asking, req_pool_idx, pos = params(one_asks)
    tokens_lp, logprobs = sample(logits, asking.batch(req_pool_idx, pos, torch.device("cpu")))
    assert logprobs is not None and torch.equal(tokens_lp, tokens)
    expected = torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected)


def test_plain_greedy_when_every_row_is_greedy() -> None:
    table, req_pool_idx, _ = params(
        [
            sp(temperature=0.0, logprobs=False),
            sp(temperature=0.0, logprobs=False),
            sp(temperature=0.7, logprobs=False),
        ]
        + [sp(temperature=0.0, logprobs=True)]
    )
    assert table.plain_greedy([0, 1])
    assert not table.plain_greedy([0, 2]), "a sampled row needs the whole sampler"
    assert table.plain_greedy([1, 3]), "logprobs are computed for the rows that ask, apart from the draw"
