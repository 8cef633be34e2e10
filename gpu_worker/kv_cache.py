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

from collections.abc import Sequence
from typing import Any

import torch


def pool_layer_shapes(model: Any) -> list[tuple[int, int]]:
    """(KV heads, head_dim) of each pool layer: the model's ``kv_layer_shapes`` where its layers
    differ or some read another's KV (Gemma 4: only the layers that own KV), else every layer alike."""
    shapes = getattr(model, "kv_layer_shapes", None)
    if shapes is not None:
        return list(shapes)
    return [(int(model.num_kv_heads), int(model.head_dim))] * int(model.num_layers)


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
        layer_shapes: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        assert num_pages >= 1, f"the KV pool needs at least one page, got {num_pages}"
        self.num_pages = num_pages
        self.page_size = page_size
        # layer_shapes: (KV heads, head_dim) per pool layer, where layers differ (pool_layer_shapes).
        shapes = list(layer_shapes) if layer_shapes is not None else [(kv_heads, head_dim)] * num_layers
        rows = num_pages * page_size
        # torch.empty: pages are written before they are read, and untouched memory stays unallocated.
        self.k = [torch.empty((rows, h, d), dtype=dtype, device=device) for h, d in shapes]
        self.v = (
            self.k if latent else [torch.empty((rows, h, d), dtype=dtype, device=device) for h, d in shapes]
        )
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
