"""The worker's checks of a ForwardBatch from the scheduler, before any of its numbers reach an index op."""

from __future__ import annotations

from itertools import accumulate

import torch

from gpu_worker.sampling.penalties import check_prefix_ids
from protocol.messages import PENDING, ForwardBatch


def check_batch(
    batch: ForwardBatch, num_pages: int, page_table_shape: torch.Size, context_len: int, vocab_size: int
) -> None:
    """Reject a malformed batch before it reaches an index op (a CUDA index fault kills the process)."""
    rows = len(batch.req_pool_idx)
    fields = (
        batch.prefix_lens,
        batch.extend_lens,
        batch.page_starts,
        batch.page_counts,
        batch.sample,
        batch.sampler,
    )
    if rows == 0 or any(len(f) != rows for f in fields):
        raise ValueError(f"batch {batch.step}: row fields must all have {rows} > 0 entries")
    if len(batch.input_ids) != sum(batch.extend_lens) or len(batch.pages) != sum(batch.page_counts):
        raise ValueError(f"batch {batch.step}: input_ids / pages do not match extend_lens / page_counts")
    max_requests, pages_per_request = page_table_shape
    if len(set(batch.req_pool_idx)) != rows or not all(0 <= i < max_requests for i in batch.req_pool_idx):
        raise ValueError(f"batch {batch.step}: req_pool_idx must be distinct and in [0, {max_requests})")
    if any(n < 1 for n in batch.extend_lens) or any(p < 0 for p in batch.prefix_lens):
        raise ValueError(f"batch {batch.step}: extend_lens must be >= 1 and prefix_lens >= 0")
    if any(p + n > context_len for p, n in zip(batch.prefix_lens, batch.extend_lens, strict=True)):
        raise ValueError(f"batch {batch.step}: a row runs past the context length {context_len}")
    ends = (s + c for s, c in zip(batch.page_starts, batch.page_counts, strict=True))
    if any(s < 0 for s in batch.page_starts) or any(e > pages_per_request for e in ends):
        raise ValueError(f"batch {batch.step}: page deltas outside [0, {pages_per_request})")
    if batch.pages and not (0 <= min(batch.pages) and max(batch.pages) < num_pages):
        raise ValueError(f"batch {batch.step}: pages must be in [0, {num_pages})")
    if min(batch.input_ids) < PENDING or max(batch.input_ids) >= vocab_size:
        raise ValueError(f"batch {batch.step}: token ids must be in [0, {vocab_size}) or PENDING")
    check_prefix_ids(batch, vocab_size)
    if min(batch.input_ids) == PENDING:
        row_ends = set(accumulate(batch.extend_lens))
        if any(tok == PENDING and i + 1 not in row_ends for i, tok in enumerate(batch.input_ids)):
            raise ValueError(f"batch {batch.step}: PENDING may only be a row's last token")
