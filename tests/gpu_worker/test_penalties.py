"""The worker's batched penalties equal the row-by-row reference, and cost nothing when unused."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from gpu_worker.sampling.penalties import ReqPoolPenalties
from protocol.messages import PENDING, ForwardBatch
from protocol.sampling import WorkerPenalties, WorkerSampling
from tests.gpu_worker.penalty_reference import penalized

VOCAB = 40
CPU = torch.device("cpu")


def sampler(penalties: WorkerPenalties | None) -> WorkerSampling:
    return WorkerSampling(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0, penalties=penalties)


def batch(rows: Sequence[tuple[int, int, list[int], WorkerSampling | None]], **extra: Any) -> ForwardBatch:
    """rows: (req_pool_idx, prefix_len, input ids, sampler or None); pages are not looked at here."""
    return ForwardBatch(
        step=0,
        req_pool_idx=[r[0] for r in rows],
        prefix_lens=[r[1] for r in rows],
        extend_lens=[len(r[2]) for r in rows],
        input_ids=[t for r in rows for t in r[2]],
        page_starts=[0] * len(rows),
        page_counts=[0] * len(rows),
        pages=[],
        sample=[True] * len(rows),
        sampler=[r[3] for r in rows],
        **extra,
    )


def feed(table: ReqPoolPenalties, fb: ForwardBatch) -> None:
    table.update(fb, torch.tensor(fb.input_ids, dtype=torch.int64))


PENALTIES = [
    WorkerPenalties(prompt_len=6, presence=0.7, frequency=0.4),
    WorkerPenalties(prompt_len=3, repetition=1.6),
    WorkerPenalties(prompt_len=5, bias_ids=[3, 9, 0], bias_values=[5.0, -2.5, 1.0]),
    WorkerPenalties(prompt_len=4, min_tokens=2, min_tokens_ids=[7, 8]),
    WorkerPenalties(
        prompt_len=7, presence=-0.5, frequency=1.5, repetition=0.8, bias_ids=[1], bias_values=[3.0]
    ),
]


def test_batched_penalties_equal_the_reference_through_chunks_and_decodes() -> None:
    """Five requests with penalties and one without; prompts in two chunks (one with a cached
    prefix in prefix_ids), then decode steps whose inputs repeat tokens."""
    rng = random.Random(0)
    table = ReqPoolPenalties(8, VOCAB, CPU, torch.float64)
    prompts = {idx: [rng.randrange(VOCAB) for _ in range(p.prompt_len)] for idx, p in enumerate(PENALTIES)}
    prompts[5] = [1, 2, 3]
    samplers = {idx: sampler(p) for idx, p in enumerate(PENALTIES)} | {5: sampler(None)}
    # Slot 0's first 2 prompt tokens are a cached prefix: the worker gets them as prefix_ids.
    first = [(s, 2 if s == 0 else 0, prompts[s][2 if s == 0 else 0 : 4], samplers[s]) for s in range(6)]
    prefix_ids = [prompts[0][:2]] + [[] for _ in range(5)]
    feed(table, batch(first, prefix_ids=prefix_ids))
    feed(table, batch([(s, 4, prompts[s][4:], None) for s in range(6) if len(prompts[s]) > 4]))
    outputs: dict[int, list[int]] = {s: [] for s in range(6)}
    for step in range(6):
        logits = torch.randn(6, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        positions = [len(prompts[s]) + len(outputs[s]) for s in range(6)]
        got = table.apply(logits.clone(), list(range(6)), positions)
        for s, p in enumerate(PENALTIES):
            expected = penalized(logits[s], prompts[s], outputs[s], p)
            assert torch.equal(got[s], expected), f"req_pool_idx {s}, step {step}"
        assert torch.equal(got[5], logits[5]), "a row without penalties is left as it is"
        drawn = [rng.choice(prompts[s] + [rng.randrange(VOCAB)]) for s in range(6)]  # repeats on purpose
        for s in range(6):
            outputs[s].append(drawn[s])
        feed(table, batch([(s, positions[s], [drawn[s]], None) for s in range(6)]))


def test_only_the_rows_with_penalties_are_touched_in_a_mixed_batch() -> None:
    table = ReqPoolPenalties(4, VOCAB, CPU, torch.float32)
    p = WorkerPenalties(prompt_len=2, repetition=2.0, bias_ids=[5], bias_values=[10.0])
    feed(table, batch([(1, 0, [5, 6], sampler(None)), (3, 0, [5, 6], sampler(p))]))
    logits = torch.randn(2, VOCAB).bfloat16()
    got = table.apply(logits, [1, 3], [2, 2])
    assert got.dtype == torch.float32
    assert torch.equal(got[0], logits[0].float())
    assert torch.equal(got[1], penalized(logits[1], [5, 6], [], p).float())


def test_no_penalties_is_the_fast_path_and_a_reused_req_pool_idx_starts_clean() -> None:
    table = ReqPoolPenalties(4, VOCAB, CPU, torch.float32)
    feed(table, batch([(0, 0, [1, 2, 3], sampler(None)), (1, 0, [4], sampler(None))]))
    logits = torch.randn(2, VOCAB)
    assert table.apply(logits, [0, 1], [3, 1]) is logits, "no row uses penalties: the logits as they came"
    assert table._tables is None, "no request ever used penalties: no tables"
    p = WorkerPenalties(prompt_len=1, frequency=1.0)
    feed(table, batch([(0, 0, [9], sampler(p))]))
    feed(table, batch([(0, 1, [9], None)]))  # 9 generated once
    assert table.apply(torch.zeros(1, VOCAB), [0], [2])[0, 9] == -1.0
    # The req_pool_idx goes to a new request (a retracted one sent again looks the same): counts restart.
    feed(table, batch([(0, 0, [4, 4], sampler(WorkerPenalties(prompt_len=1, frequency=1.0)))]))
    again = table.apply(torch.zeros(1, VOCAB), [0], [2])[0]
    assert again[9] == 0.0 and again[4] == -1.0, "4 at position 1 is generated, 9 is the old request's"
    feed(table, batch([(0, 0, [4], sampler(None))]))
    logits = torch.zeros(1, VOCAB)
    assert table.apply(logits, [0], [1]) is logits, "a req_pool_idx reused without penalties is plain again"


def test_pending_inputs_are_counted_as_the_tokens_they_stand_for() -> None:
    """Under overlap the decode input arrives as PENDING; the runner resolves it before update."""
    table = ReqPoolPenalties(2, VOCAB, CPU, torch.float64)
    p = WorkerPenalties(prompt_len=2, presence=1.0)
    feed(table, batch([(0, 0, [3, 4], sampler(p))]))
    pending = batch([(0, 2, [PENDING], None)])
    table.update(pending, torch.tensor([11]))  # the token the req_pool_idx drew last was 11
    got = table.apply(torch.zeros(1, VOCAB, dtype=torch.float64), [0], [3])[0]
    assert got[11] == -1.0 and got[3] == 0.0 and got[4] == 0.0


def test_min_tokens_masks_stop_ids_until_enough_were_generated() -> None:
    table = ReqPoolPenalties(1, VOCAB, CPU, torch.float32)
    p = WorkerPenalties(prompt_len=3, min_tokens=2, min_tokens_ids=[2, 7])
    feed(table, batch([(0, 0, [1, 1, 1], sampler(p))]))
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 50.0
    masked = [bool(torch.isinf(table.apply(logits.clone(), [0], [pos])[0, 2])) for pos in (3, 4, 5, 6)]
    assert masked == [True, True, False, False]


def test_many_distinct_tokens_grow_the_seen_lists() -> None:
    """Hundreds of distinct prompt and output tokens per req_pool_idx (past the first width of seen_ids),
    two requests in chunks of different sizes: still the reference, at every step."""
    vocab, rng = 2000, random.Random(3)
    table = ReqPoolPenalties(3, vocab, CPU, torch.float64)
    pens = {
        0: WorkerPenalties(prompt_len=300, repetition=1.4, frequency=0.2),
        2: WorkerPenalties(prompt_len=150, presence=0.9),
    }
    prompts = {s: [rng.randrange(vocab) for _ in range(p.prompt_len)] for s, p in pens.items()}
    for start in range(0, 300, 70):
        rows = [(s, start, prompts[s][start : start + 70], sampler(pens[s]) if start == 0 else None)
                for s in pens if start < len(prompts[s])]  # fmt: skip
        feed(table, batch(rows))
    outputs: dict[int, list[int]] = {0: [], 2: []}
    for step in range(120):
        logits = torch.randn(2, vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        positions = [len(prompts[s]) + len(outputs[s]) for s in pens]
        got = table.apply(logits.clone(), list(pens), positions)
        for r, s in enumerate(pens):
            assert torch.equal(got[r], penalized(logits[r], prompts[s], outputs[s], pens[s])), (s, step)
        drawn = {s: rng.randrange(vocab) if step % 3 else rng.choice(prompts[s]) for s in pens}
        feed(table, batch([(s, positions[r], [drawn[s]], None) for r, s in enumerate(pens)]))
        for s in pens:
            outputs[s].append(drawn[s])
    assert table._tables is not None and table._tables.seen_ids.shape[1] >= 300
