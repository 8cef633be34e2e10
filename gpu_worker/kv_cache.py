"""The paged KV pool and the page table the scheduler fills by deltas.

Layout: per layer one K and one V tensor of shape
``[num_pages * page_size, kv_heads, head_dim]``: a token's KV is one row, so
writing a batch's new K/V is a single indexed store and gathering a row's
history is a single index_select, whatever the page size. The page table is
``[max_running_requests, ceil(context_len / page_size)]`` of page numbers; the
scheduler owns the allocator and only ever tells us which pages a req_pool_idx (a row) got.

A latent pool (``latent=True``, models/mla.py) holds one vector a token a layer, the normed latent and
the rotated rope key side by side (``kv_heads`` 1): attention reads it as the key and, its leading
dimensions, as the value, so ``v`` is ``k`` and the pool's memory is half of a K/V pair's.
"""

from __future__ import annotations

import torch


class KVPool:
    """K/V tensors of every layer plus the page table (one row per req_pool_idx)."""

    def __init__(
        self,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        max_requests: int,
        context_len: int,
        dtype: torch.dtype,
        device: torch.device,
        latent: bool = False,
    ) -> None:
        assert num_pages >= 1, f"the KV pool needs at least one page, got {num_pages}"
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_pages * page_size, kv_heads, head_dim)
        # torch.empty: pages are written before they are read, and untouched memory stays unallocated.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = self.k if latent else [torch.empty(shape, dtype=dtype, device=device) for _ in self.k]
        pages_per_request = -(-context_len // page_size)
        # Zeros, not empty: any entry gathered through is then a real page of the pool.
        self.page_table = torch.zeros((max_requests, pages_per_request), dtype=torch.int64, device=device)

    def apply_page_deltas(
        self, req_pool_idx: list[int], page_starts: list[int], page_counts: list[int], pages: list[int]
    ) -> None:
        """Row i appends ``page_counts[i]`` of the flat ``pages`` to page-table row ``req_pool_idx[i]``, from
        index ``page_starts[i]``."""
        total = len(pages)
        if total == 0:
            return
        device = self.page_table.device
        counts = torch.tensor(page_counts, device=device)
        rows = torch.repeat_interleave(torch.tensor(req_pool_idx, device=device), counts, output_size=total)
        first = torch.repeat_interleave(torch.tensor(page_starts, device=device), counts, output_size=total)
        offsets = torch.cumsum(counts, 0) - counts  # where each row's run starts in ``pages``
        within = torch.arange(total, device=device) - torch.repeat_interleave(
            offsets, counts, output_size=total
        )
        self.page_table[rows, first + within] = torch.tensor(pages, dtype=torch.int64, device=device)
