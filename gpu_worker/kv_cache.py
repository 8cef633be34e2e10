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

A latent pool may also be float8 e4m3 (``--kv-cache-dtype fp8_e4m3``, no scale): one byte a value,
half a 16-bit pool. Rows go in through ``store_rows`` (saturated to +-448, where torch's cast may make
a larger value NaN) and are copied as bytes: torch's CPU index_copy_ has no float8 kernel. A row that
attends its own new latents reads them ``as_stored`` there: at 3 mantissa bits, reading them as
computed would make a prompt's tokens depend on how it was chunked (16-bit pools keep that order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from gpu_worker.config import why_no_fp8_pool

if TYPE_CHECKING:
    from gpu_worker.backends.base import Backend

KV_DTYPES = {  # --kv-cache-dtype's names but auto (gpu_worker/config.py)
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
}
FP8_MAX = 448.0  # float8 e4m3fn's largest finite value


def pool_dtype(name: str, backend: Backend, dtype: torch.dtype, latent: bool) -> torch.dtype:
    """--kv-cache-dtype ``name``'s dtype under activations of ``dtype``; ValueError where the backend
    cannot read a pool of it (a float8 one: config.why_no_fp8_pool)."""
    if name == "auto":
        return backend.kv_cache_dtype(dtype)
    if name == "fp8_e4m3":
        c_kernels = getattr(backend, "kernels", None) is not None  # the CPU backend's, once they built
        why_not = why_no_fp8_pool(latent, backend.name, c_kernels, str(dtype).removeprefix("torch."))
        if why_not is not None:
            raise ValueError(f"--kv-cache-dtype fp8_e4m3: {why_not}")
    return KV_DTYPES[name]


def store_rows(cache: torch.Tensor, locs: torch.Tensor, rows: torch.Tensor) -> None:
    """``rows`` rounded to the pool's dtype into pool rows ``locs`` (a float8 pool's saturated)."""
    if cache.dtype == torch.float8_e4m3fn:
        rows = rows.clamp(-FP8_MAX, FP8_MAX).to(cache.dtype)
        cache.view(torch.uint8).index_copy_(0, locs, rows.view(torch.uint8))
    else:
        cache.index_copy_(0, locs, rows.to(cache.dtype))


def as_stored(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` as a float8 pool of ``dtype`` holds them, in their own dtype; else as they are."""
    if dtype != torch.float8_e4m3fn:
        return rows
    return rows.clamp(-FP8_MAX, FP8_MAX).to(dtype).to(rows.dtype)


def copy_rows(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Pool rows ``src`` into rows ``dst``, as they are stored."""
    raw = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
    raw.index_copy_(0, dst, raw.index_select(0, src))


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
