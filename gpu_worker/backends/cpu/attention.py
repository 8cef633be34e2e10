"""The CPU backend's attention: decode rows by the C kernel, read in place through the page table
(csrc/attention.c), every row at its own length in one call; extend rows by torch (torch_ref).

A batch whose rows all decode goes to the kernel with its new K/V, which it writes itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from gpu_worker.backends.cpu.decode_rows import DecodeRows
from gpu_worker.backends.cpu.kernels import CpuKernels
from gpu_worker.backends.torch_ref import attention as torch_attention
from gpu_worker.forward_context import PLAIN, AttentionOptions


@dataclass(frozen=True)
class PagedDecodeRows:
    """Every decode row of the batch, for the C kernel: it reads their KV through the page table."""

    tokens: torch.Tensor  # [B] flat indices of their tokens (query and output rows)
    req_pool_idx: torch.Tensor  # [B] page-table rows
    kv_lens: torch.Tensor  # [B] KV tokens each row attends, its new one included
    rows: DecodeRows  # the above as the kernel reads them, checked once for all layers


@dataclass
class CpuAttentionMetadata:
    """torch_ref's metadata of the extend rows, and the decode rows for the kernel (None: none)."""

    torch_meta: torch_attention.AttentionMetadata  # its decode groups are empty: the kernel's rows
    paged_decode: PagedDecodeRows | None
    all_decode: bool  # every row decodes: the tokens are arange(T)
    batch: tuple[torch.Tensor, int, list[int], list[int], list[int]]  # build_metadata's arguments
    # torch_ref's metadata with its decode groups, built on first use by a layer the kernel does not
    # take (a sliding window, soft-capping), then shared by the batch's other such layers.
    _with_groups: torch_attention.AttentionMetadata | None = field(default=None, repr=False)

    @property
    def in_order(self) -> bool:
        return self.all_decode

    def torch_metadata(self) -> torch_attention.AttentionMetadata:
        """torch_ref's metadata of every row."""
        if self.paged_decode is None:
            return self.torch_meta
        if self._with_groups is None:
            page_table, page_size, rows, prefix_lens, extend_lens = self.batch
            _, self._with_groups = torch_attention.build_metadata(
                page_table, page_size, rows, prefix_lens, extend_lens, page_table.device
            )
        return self._with_groups


def build_metadata(
    kernels: CpuKernels,
    page_table: torch.Tensor,
    page_size: int,
    req_pool_idx: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
) -> tuple[torch.Tensor, CpuAttentionMetadata]:
    """Positions [T] and the batch's metadata: torch_ref's for the extend rows (and, for layers the
    kernel does not take, its decode groups), the kernel's rows for the decode rows."""
    device = page_table.device
    positions, torch_meta = torch_attention.build_metadata(
        page_table, page_size, req_pool_idx, prefix_lens, extend_lens, device, decode_groups=False
    )
    starts = list(accumulate(extend_lens[:-1], initial=0))
    decode = [i for i, n in enumerate(extend_lens) if n == 1]
    paged = None
    if decode:
        tokens = torch.tensor([starts[i] for i in decode], dtype=torch.int64, device=device)
        rows_t = torch.tensor([req_pool_idx[i] for i in decode], dtype=torch.int64, device=device)
        lens = torch.tensor([prefix_lens[i] + 1 for i in decode], dtype=torch.int64, device=device)
        paged = PagedDecodeRows(
            tokens=tokens,
            req_pool_idx=rows_t,
            kv_lens=lens,
            rows=kernels.decode_rows(tokens, rows_t, lens, page_table, page_size),
        )
    meta = CpuAttentionMetadata(
        torch_meta=torch_meta,
        paged_decode=paged,
        all_decode=len(decode) == len(extend_lens),
        batch=(page_table, page_size, req_pool_idx, prefix_lens, extend_lens),
    )
    return positions, meta


def attend(
    kernels: CpuKernels,
    meta: CpuAttentionMetadata,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    options: AttentionOptions,
) -> torch.Tensor:
    """Write the batch's new K/V and attend every row; q: [T, Hq, D], k/v: [T, Hkv, D]."""
    paged = meta.paged_decode
    if paged is None or (options is not PLAIN and options != PLAIN):  # the kernel: plain attention only
        return torch_attention.attend(meta.torch_metadata(), q, k, v, k_cache, v_cache, options)
    out = torch.empty_like(q)
    if meta.all_decode:  # the kernel writes the rows' K/V itself
        kernels.attend(q, k_cache, v_cache, out, paged.rows, new_kv=(k, v))
        return out
    tm = meta.torch_meta
    torch_attention.store_kv(k_cache, v_cache, k, v, tm.out_locs)
    kernels.attend(q, k_cache, v_cache, out, paged.rows)
    torch_attention.attend_into(out, tm, q, k, v, k_cache, v_cache, options)  # its extend rows
    return out
