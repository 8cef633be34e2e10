"""The CPU backend's attention: decode rows by the C kernel, read in place through the page table
(csrc/attention.c), every row at its own length in one call; extend rows by torch (the torch backend's).

A short extend row (up to KERNEL_MAX_EXTEND tokens: a speculative verify row, a small chunk) goes to
the kernel too, as one decode row per token, each over the positions up to its own: for a few
queries over a long prefix that is one pass over the paged KV each, against torch's gather of the
whole prefix and its SDPA call per layer, which a speculative verify row pays in every layer of
every step (docs/benchmarks-history.md, "Numbers behind the code's choices").
A batch whose rows all go to the kernel writes its new K/V there (the kernel itself, or first, where
two of its rows are one request's), and may run as one call (decode_layers.py).
A latent pool's rows (latent attention's absorbed decode: one KV row a token, K and V alike) go to
csrc/mla.c instead, which reads each row once for every head.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from gpu_worker.backends.cpu.build import DTYPE_CODES, LATENT_KV_DTYPE_CODES
from gpu_worker.backends.cpu.decode_rows import DecodeRows
from gpu_worker.backends.cpu.kernels import CpuKernels
from gpu_worker.backends.torch import attention as torch_attention
from gpu_worker.forward_context import AttentionOptions
from gpu_worker.kv_cache import as_stored, store_rows

KERNEL_MAX_EXTEND = 16  # tokens of the longest extend row the kernel attends, a decode row per token


@dataclass(frozen=True)
class PagedDecodeRows:
    """Every decode row of the batch (a short extend row's tokens, one each), for the C kernel: it
    reads their KV through the page table."""

    tokens: torch.Tensor  # [B] flat indices of their tokens (query and output rows)
    req_pool_idx: torch.Tensor  # [B] page-table rows
    kv_lens: torch.Tensor  # [B] KV tokens each row attends, its new one included
    rows: DecodeRows  # the above as the kernel reads them, checked once for all layers


@dataclass
class CpuAttentionMetadata:
    """the torch backend's metadata of the extend rows, and the decode rows for the kernel (None: none)."""

    # its decode groups are empty: the kernel's rows. None until first read where every row is a
    # one-token decode row (a steady decode step): the one-call decodes read none of it.
    _torch_meta: torch_attention.AttentionMetadata | None
    paged_decode: PagedDecodeRows | None
    all_decode: bool  # every row goes to the kernel: the tokens are arange(T)
    batch: tuple[torch.Tensor, int, list[int], list[int], list[int]]  # build_metadata's arguments
    # the torch backend's metadata with its decode groups, built on first use by a layer the kernel does not
    # take (soft-capping), then shared by the batch's other such layers.
    _with_groups: torch_attention.AttentionMetadata | None = field(default=None, repr=False)

    @property
    def in_order(self) -> bool:
        return self.all_decode

    @property
    def torch_meta(self) -> torch_attention.AttentionMetadata:
        """the torch backend's metadata of the extend rows (the K/V locations of every row)."""
        if self._torch_meta is None:
            page_table, page_size, rows, prefix_lens, extend_lens = self.batch
            _, self._torch_meta = torch_attention.build_metadata(
                page_table, page_size, rows, prefix_lens, extend_lens, page_table.device, KERNEL_MAX_EXTEND
            )
        return self._torch_meta

    def torch_metadata(self) -> torch_attention.AttentionMetadata:
        """the torch backend's metadata of every row."""
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
    """Positions [T] and the batch's metadata: the torch backend's for the extend rows (and, for layers the
    kernel does not take, its decode groups), the kernel's rows for the decode rows."""
    if max(extend_lens) == 1 == min(extend_lens):
        return _decode_step_metadata(kernels, page_table, page_size, req_pool_idx, prefix_lens, extend_lens)
    device = page_table.device
    positions, torch_meta = torch_attention.build_metadata(
        page_table, page_size, req_pool_idx, prefix_lens, extend_lens, device, KERNEL_MAX_EXTEND
    )
    starts = list(accumulate(extend_lens[:-1], initial=0))
    decode = [i for i, n in enumerate(extend_lens) if n <= KERNEL_MAX_EXTEND]
    paged = None
    if decode:
        # A row's tokens as adjacent decode rows of one request (the kernel needs a request's rows adjacent).
        spans = [(starts[i], req_pool_idx[i], prefix_lens[i], extend_lens[i]) for i in decode]
        tokens = torch.tensor([s + j for s, _, _, n in spans for j in range(n)], dtype=torch.int64)
        rows_t = torch.tensor([r for _, r, _, n in spans for _ in range(n)], dtype=torch.int64)
        lens = torch.tensor([p + j + 1 for _, _, p, n in spans for j in range(n)], dtype=torch.int64)
        tokens, rows_t, lens = tokens.to(device), rows_t.to(device), lens.to(device)
        paged = PagedDecodeRows(
            tokens=tokens,
            req_pool_idx=rows_t,
            kv_lens=lens,
            rows=kernels.decode_rows(tokens, rows_t, lens, page_table, page_size),
        )
    meta = CpuAttentionMetadata(
        _torch_meta=torch_meta,
        paged_decode=paged,
        all_decode=len(decode) == len(extend_lens),
        batch=(page_table, page_size, req_pool_idx, prefix_lens, extend_lens),
    )
    return positions, meta


def _decode_step_metadata(
    kernels: CpuKernels,
    page_table: torch.Tensor,
    page_size: int,
    req_pool_idx: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
) -> tuple[torch.Tensor, CpuAttentionMetadata]:
    """``build_metadata`` of a batch of one-token rows, every one the kernel's: the positions and the
    kernel's rows from one tensor, the torch backend's metadata left until a layer reads it (at one
    row that build is most of the step's Python beyond the C calls: docs/benchmarks-history.md)."""
    rows = len(req_pool_idx)
    columns = [prefix_lens, range(rows), req_pool_idx, [p + 1 for p in prefix_lens]]
    positions, tokens, rows_t, lens = torch.tensor(columns, dtype=torch.int64).unbind(0)
    paged = PagedDecodeRows(
        tokens=tokens,
        req_pool_idx=rows_t,
        kv_lens=lens,
        rows=kernels.decode_rows(tokens, rows_t, lens, page_table, page_size),
    )
    batch = (page_table, page_size, req_pool_idx, prefix_lens, extend_lens)
    return positions, CpuAttentionMetadata(_torch_meta=None, paged_decode=paged, all_decode=True, batch=batch)


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
    if _latent_fits(q, k, v, k_cache, v_cache, options):
        return _attend_latent(kernels, meta, q, k, k_cache, options)
    # The kernel: a window, a scale, sinks; no soft-capping, and heads within its limits (a model's
    # layers may differ: Gemma 4's global heads are twice its sliding ones').
    fits = kernels.supports(q.shape[1], k_cache.shape[1], q.shape[2], q.dtype)
    if paged is None or options.logit_softcap > 0 or not fits:
        return torch_attention.attend(meta.torch_metadata(), q, k, v, k_cache, v_cache, options)
    window, scale = options.sliding_window, options.scale
    sinks = None if options.sinks is None else options.sinks.to(torch.float32).contiguous()
    out = torch.empty_like(q)
    if meta.all_decode:  # the kernel writes the rows' K/V itself
        kernels.attend(
            q, k_cache, v_cache, out, paged.rows, (k, v), sliding_window=window, scale=scale, sinks=sinks
        )
        return out
    tm = meta.torch_meta
    torch_attention.store_kv(k_cache, v_cache, k, v, tm.out_locs)
    kernels.attend(q, k_cache, v_cache, out, paged.rows, sliding_window=window, scale=scale, sinks=sinks)
    torch_attention.attend_into(out, tm, q, k, v, k_cache, v_cache, options)  # its extend rows
    return out


def _latent_fits(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    options: AttentionOptions,
) -> bool:
    """A latent pool's absorbed decode (models/mla.py: one KV row a token, its own value) that
    csrc/mla.c takes: every head in one pass over the rows and no bound on heads or row size, where
    the paged kernel reads them once a group of heads, for K and again for V, and refuses real
    latent rows (576 values) for torch's gather."""
    plain = options.logit_softcap == 0 and options.sinks is None and options.sliding_window == 0
    return (
        plain
        and k is v
        and k_cache is v_cache
        and k.shape[1] == 1
        and q.dtype in DTYPE_CODES
        and k_cache.dtype in LATENT_KV_DTYPE_CODES
        and k_cache.is_contiguous()
    )


def _attend_latent(
    kernels: CpuKernels,
    meta: CpuAttentionMetadata,
    q: torch.Tensor,
    entry: torch.Tensor,
    cache: torch.Tensor,
    options: AttentionOptions,
) -> torch.Tensor:
    """The batch's latent rows written, its decode rows on csrc/mla.c, its extend rows by torch (which
    reads a float8 pool widened: torch's CPU ops have no float8 store)."""
    paged, tm = meta.paged_decode, meta.torch_meta
    store_rows(cache, tm.out_locs, entry)
    q = q.contiguous()
    out = torch.empty_like(q)
    scale = q.shape[2] ** -0.5 if options.scale is None else options.scale
    if paged is not None:
        kernels.latent_attend(q, cache, out, paged.rows, q.shape[2], scale)
    if not meta.all_decode:
        own = as_stored(entry, cache.dtype)  # a prompt row's own latents, as the pool holds them
        torch_attention.attend_into(out, tm, q, own, own, cache, cache, options)
    return out
