"""n > 1 in the worker: forks, which draw a first token for their own req_pool_idx from another row's logits,
and KV page copies (ForwardBatch's fork_* and copy_* fields).

A fork is choice i > 0 of a request whose prompt the batch's row ``fork_rows[j]`` ends: its req_pool_idx
gets its own sampler (the row's, with seed + i) and the row's penalty counts (the prompt's tokens),
and its token is drawn from a copy of the row's logits, with every per-request step the row's own draw
has. The scheduler shares the prompt's full KV pages between the choices; a page it cannot share
(the partly filled last one, or all of them without a prefix cache) is copied here after the forward
that wrote it, before any later batch can write the page the fork will decode into.
"""

from __future__ import annotations

import torch

from gpu_worker.kv_cache import KVPool, copy_rows
from protocol.messages import ForwardBatch


def copy_pages(kv: KVPool, src: list[int], dst: list[int]) -> None:
    """Every layer's K and V of page ``src[k]`` into page ``dst[k]``."""
    if not src:
        return
    device = kv.k[0].device
    within = torch.arange(kv.page_size, device=device)
    src_rows = (torch.tensor(src, device=device)[:, None] * kv.page_size + within).flatten()
    dst_rows = (torch.tensor(dst, device=device)[:, None] * kv.page_size + within).flatten()
    for cache in (*kv.k, *kv.v):
        copy_rows(cache, src_rows, dst_rows)


def with_forks(
    logits: torch.Tensor, req_pool_idx: list[int], positions: list[int], rows: list[int], batch: ForwardBatch
) -> tuple[torch.Tensor, list[int], list[int]]:
    """The sampled rows' ``logits``, ``req_pool_idx`` and ``positions`` (of batch rows ``rows``) followed by
    the forks': each a copy of its row's logits, drawn for its req_pool_idx at its row's position."""
    if not batch.fork_rows:
        return logits, req_pool_idx, positions
    index_of = {row: k for k, row in enumerate(rows)}
    parents = [index_of[row] for row in batch.fork_rows]
    forked = logits.index_select(0, torch.tensor(parents, dtype=torch.int64, device=logits.device))
    return (
        torch.cat([logits, forked]),
        req_pool_idx + list(batch.fork_req_pool_idx),
        positions + [positions[k] for k in parents],
    )
