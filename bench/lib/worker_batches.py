"""Forward batches for timing the model runner alone: ``rows`` greedy rows in fixed page-table rows and pages,
their KV filled once, then the same decode (or prefill) step repeated."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from protocol.messages import ForwardBatch
from protocol.sampling import WorkerSampling

if TYPE_CHECKING:
    from gpu_worker.model_runner import ModelRunner

GREEDY = WorkerSampling(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0)
PAGE_SIZE = 16


def batch(step: int, rows: int, prefix_len: int, extend_len: int, first: bool) -> ForwardBatch:
    """``rows`` rows at req_pool_idx 0..rows-1, each owning pages [req_pool_idx * P, (req_pool_idx + 1) * P).

    ``first``: the batch that hands the pages out and sets the sampler (later
    steps repeat the same positions and overwrite the same KV, as far as cost goes
    the same as a real decode at that context).
    """
    pages_per_row = -(-(prefix_len + extend_len + 1) // PAGE_SIZE)  # + the decode steps' token
    return ForwardBatch(
        step=step,
        req_pool_idx=list(range(rows)),
        prefix_lens=[prefix_len] * rows,
        extend_lens=[extend_len] * rows,
        input_ids=[(7 * i + 11) % 40000 + 100 for i in range(rows * extend_len)],
        page_starts=[0] * rows,
        page_counts=[pages_per_row if first else 0] * rows,
        pages=[p for r in range(rows) for p in range(r * pages_per_row, (r + 1) * pages_per_row)]
        if first
        else [],
        sample=[True] * rows,
        sampler=[GREEDY if first else None] * rows,
    )


def prepare(runner: ModelRunner, rows: int, context: int) -> Callable[[int], None]:
    """Fill ``rows`` requests with ``context`` tokens of KV; return a step(step_no) running one decode."""
    runner.execute(batch(0, rows, 0, context, first=True))
    return lambda step: _run(runner, batch(step, rows, context, 1, first=False))


def prepare_prefill(runner: ModelRunner, tokens: int, prompts: int = 1) -> Callable[[int], None]:
    """A step(step_no) prefilling ``prompts`` fresh prompts of ``tokens`` tokens each, in one batch."""
    runner.execute(batch(0, prompts, 0, tokens, first=True))
    return lambda step: _run(runner, batch(step, prompts, 0, tokens, first=False))


def _run(runner: ModelRunner, b: ForwardBatch) -> None:
    runner.execute(b)
