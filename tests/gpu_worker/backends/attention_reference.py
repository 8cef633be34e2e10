"""A paged batch for the attention kernels, and the float64 attention they must match.

The batch's pages are a random permutation of the pool's, so a row's KV is never contiguous, and the
pool is filled with random K/V at once: the kernels read only rows the page table points at.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedBatch:
    """Rows of (prefix_len, extend_len) over a random page table, with random Q and K/V pools."""

    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [pages * page_size, Hkv, D]
    v_cache: torch.Tensor
    page_table: torch.Tensor  # int64 [max_requests, pages_per_request]
    page_size: int
    req_pool_idx: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]


def paged_batch(
    lens: list[tuple[int, int]],
    *,
    page_size: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    device: str,
) -> PagedBatch:
    """A batch of rows ``(prefix_len, extend_len)`` in page-table rows shuffled among spare ones."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_row = [-(-(p + e) // page_size) for p, e in lens]
    pages_per_request = max(pages_per_row) + 1  # a spare column: the kernel must not read past a row
    num_pages = sum(pages_per_row) + 3  # spare pages nobody owns
    page_table = torch.zeros((len(lens) + 2, pages_per_request), dtype=torch.int64)
    free = torch.randperm(num_pages, generator=gen).tolist()
    req_pool_idx = random.Random(seed).sample(range(len(lens) + 2), len(lens))
    for idx, count in zip(req_pool_idx, pages_per_row, strict=True):
        page_table[idx, :count] = torch.tensor([free.pop() for _ in range(count)])
    shape = (num_pages * page_size, kv_heads, head_dim)
    return PagedBatch(
        q=torch.randn((sum(e for _, e in lens), q_heads, head_dim), generator=gen).to(dtype).to(device),
        k_cache=torch.randn(shape, generator=gen).to(dtype).to(device),
        v_cache=torch.randn(shape, generator=gen).to(dtype).to(device),
        page_table=page_table.to(device),
        page_size=page_size,
        req_pool_idx=req_pool_idx,
        prefix_lens=[p for p, _ in lens],
        extend_lens=[e for _, e in lens],
    )


def reference_attention(
    batch: PagedBatch, scale: float, sliding_window: int = 0, logit_softcap: float = 0.0
) -> torch.Tensor:
    """Float64 causal attention of every row, its KV gathered through the page table: ``[T, Hq, D]``."""
    q_heads, kv_heads = batch.q.shape[1], batch.k_cache.shape[1]
    outs = []
    q_start = 0
    rows = zip(batch.req_pool_idx, batch.prefix_lens, batch.extend_lens, strict=True)
    for idx, prefix_len, extend_len in rows:
        kv_pos = torch.arange(prefix_len + extend_len)
        locs = batch.page_table[idx].cpu()[kv_pos // batch.page_size] * batch.page_size
        locs += kv_pos % batch.page_size
        k = batch.k_cache.cpu()[locs].double().repeat_interleave(q_heads // kv_heads, dim=1)
        v = batch.v_cache.cpu()[locs].double().repeat_interleave(q_heads // kv_heads, dim=1)
        q = batch.q.cpu()[q_start : q_start + extend_len].double()
        scores = torch.einsum("thd,nhd->htn", q, k) * scale
        if logit_softcap > 0:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        q_pos = prefix_len + torch.arange(extend_len)
        hidden = kv_pos[None, :] > q_pos[:, None]
        if sliding_window > 0:
            hidden |= kv_pos[None, :] <= q_pos[:, None] - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append(torch.einsum("htn,nhd->thd", scores.softmax(dim=-1), v))
        q_start += extend_len
    return torch.cat(outs)
