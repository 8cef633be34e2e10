"""Attention over the paged KV pool for one mixed batch.

Rows come in two kinds, each attended in the cheapest shape:
- decode rows (one new token), on CPU with our C kernel (cpu_kernels.py): one
  call for all of them, each row read in place through the page table at its
  own length.
- decode rows elsewhere (CUDA, float64, no compiler, --disable-cpu-kernels):
  batched calls over groups of rows of similar KV length (usually one group).
  A group's KV is gathered by slot index into [rows, max_len], padded, with a
  length mask (none when all lengths agree).
  Grouping by length bounds the padding: one long row no longer makes every
  short row gather and attend over its length. The query heads of a KV head
  are laid along the "query length" axis, so GQA needs no repeat of K/V.
- extend rows (a prompt or a chunk of one): one call each, queries
  [prefix_len, prefix_len + extend_len) over KV [0, prefix_len + extend_len),
  causal. A row with no prefix reads its fresh K/V directly.

Everything here is built once per batch (``AttentionMetadata``) and shared by
all layers; the per-layer work is a write of the new K/V and the calls above.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from gpu_worker.backends.cpu.kernels import CpuKernels, DecodeRows

# Padding a decode group by up to this many KV tokens is cheaper than one more attention call per layer.
PAD_FLOOR_TOKENS = 1024


@dataclass(frozen=True)
class ExtendRow:
    """One extend row: its tokens are ``[start, start + length)`` of the flat batch."""

    start: int
    length: int
    prefix_len: int
    kv_locs: torch.Tensor | None  # [prefix_len + length] KV slots; None when prefix_len == 0
    mask: torch.Tensor | None  # [length, prefix_len + length] bool; None: plain causal


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows of similar KV length, attended in one call."""

    tokens: torch.Tensor  # [B] flat indices of their tokens
    kv_locs: torch.Tensor  # [B * L] KV slots, row-major, padded with a valid slot of the same row
    max_len: int  # L
    mask: torch.Tensor | None  # [B, 1, 1, L] bool, True = attend; None: every row has L tokens


@dataclass(frozen=True)
class PagedDecodeRows:
    """Every decode row of the batch, for the C kernel: it reads their KV through the page table."""

    kernels: CpuKernels
    tokens: torch.Tensor  # [B] flat indices of their tokens (query and output rows)
    slots: torch.Tensor  # [B] request slots
    kv_lens: torch.Tensor  # [B] KV tokens each row attends, its new one included
    page_table: torch.Tensor
    rows: DecodeRows  # the above as the kernel reads them, checked once for all layers


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this batch's K/V go and what each row's queries attend to."""

    out_locs: torch.Tensor  # [T] KV slot of every new token
    decode: tuple[DecodeGroup, ...]
    extends: tuple[ExtendRow, ...]
    in_order: bool  # every row decodes (tokens are arange(T)), in one group or in paged_decode
    paged_decode: PagedDecodeRows | None = None  # the decode rows when the C kernel attends them


@dataclass(frozen=True)
class ForwardContext:
    """What a model's forward needs besides the token ids."""

    positions: torch.Tensor  # [T] position of every token
    attn: AttentionMetadata
    k_cache: list[torch.Tensor]  # per layer [num_slots, kv_heads, head_dim]
    v_cache: list[torch.Tensor]


def paged_attention(
    layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
) -> torch.Tensor:
    """Write this layer's new K/V into the pool, then attend. q: [T, Hq, D], k/v: [T, Hkv, D]."""
    meta = ctx.attn
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    paged = meta.paged_decode
    if meta.in_order and paged is not None:  # all decode rows: the kernel writes their K/V itself
        out = torch.empty_like(q)
        paged.kernels.attend(q, k_cache, v_cache, out, paged.rows, new_kv=(k, v))
        return out
    # index_copy_/index_select, not advanced indexing: several times faster on CPU.
    k_cache.index_copy_(0, meta.out_locs, k)
    v_cache.index_copy_(0, meta.out_locs, v)
    if meta.in_order and paged is None:
        return _decode_attention(q, k_cache, v_cache, meta.decode[0])
    out = torch.empty_like(q)
    if paged is not None:
        paged.kernels.attend(q, k_cache, v_cache, out, paged.rows)
    for group in meta.decode:
        part = _decode_attention(q.index_select(0, group.tokens), k_cache, v_cache, group)
        out.index_copy_(0, group.tokens, part)
    for row in meta.extends:
        rows = slice(row.start, row.start + row.length)
        if row.kv_locs is None:
            row_k, row_v = k[rows], v[rows]
        else:
            row_k, row_v = k_cache.index_select(0, row.kv_locs), v_cache.index_select(0, row.kv_locs)
        out[rows] = _extend_attention(q[rows], row_k, row_v, row.mask)
    return out


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup
) -> torch.Tensor:
    rows, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    # [B, L, Hkv, D] -> [B, Hkv, L, D]; the G query heads sharing a KV head act as G queries.
    shape = (rows, group.max_len, kv_heads, head_dim)
    k = k_cache.index_select(0, group.kv_locs).view(shape).transpose(1, 2)
    v = v_cache.index_select(0, group.kv_locs).view(shape).transpose(1, 2)
    q = q.view(rows, kv_heads, q_heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask)
    return out.reshape(rows, q_heads, head_dim)


def _extend_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=gqa,
    )
    return out.transpose(0, 1)


def build_metadata(
    page_table: torch.Tensor,
    page_size: int,
    slots: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
    device: torch.device,
    kernels: CpuKernels | None = None,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions [T] and the attention metadata of one batch, from its O(rows) lists.

    ``kernels``: attend the decode rows with the C kernel (the caller checked it takes
    this model's dtype and head shapes); None: with torch, in length groups.
    """
    starts = list(accumulate(extend_lens[:-1], initial=0))
    total = starts[-1] + extend_lens[-1]
    lens = torch.tensor(extend_lens, device=device)
    row_of_token = torch.repeat_interleave(torch.arange(len(slots), device=device), lens, output_size=total)
    row_start = torch.tensor(starts, device=device)[row_of_token]
    prefix = torch.tensor(prefix_lens, device=device)
    positions = prefix[row_of_token] + torch.arange(total, device=device) - row_start
    slot_t = torch.tensor(slots, device=device)
    out_locs = kv_locations(page_table, page_size, slot_t[row_of_token], positions)

    extends = tuple(
        _extend_row(page_table, page_size, slots[i], starts[i], prefix_lens[i], n, device)
        for i, n in enumerate(extend_lens)
        if n > 1
    )
    kv_lens = {i: prefix_lens[i] + 1 for i, n in enumerate(extend_lens) if n == 1}
    all_decode = len(kv_lens) == len(slots)  # then the tokens are arange(T)
    if kernels is not None:
        paged = _paged_decode_rows(kernels, page_table, page_size, slots, starts, kv_lens, device)
        return positions, AttentionMetadata(
            out_locs=out_locs, decode=(), extends=extends, in_order=all_decode, paged_decode=paged
        )
    decode = tuple(
        _decode_group(page_table, page_size, [(slots[i], starts[i], kv_lens[i]) for i in rows], device)
        for rows in length_groups(kv_lens)
    )
    in_order = len(decode) == 1 and all_decode
    meta = AttentionMetadata(out_locs=out_locs, decode=decode, extends=extends, in_order=in_order)
    return positions, meta


def _paged_decode_rows(
    kernels: CpuKernels,
    page_table: torch.Tensor,
    page_size: int,
    slots: list[int],
    starts: list[int],
    kv_lens: dict[int, int],
    device: torch.device,
) -> PagedDecodeRows | None:
    """kv_lens: decode row -> its KV length; None when the batch has no decode row."""
    if not kv_lens:
        return None
    rows = list(kv_lens)
    tokens = torch.tensor([starts[i] for i in rows], dtype=torch.int64, device=device)
    slot_t = torch.tensor([slots[i] for i in rows], dtype=torch.int64, device=device)
    lens = torch.tensor(list(kv_lens.values()), dtype=torch.int64, device=device)
    return PagedDecodeRows(
        kernels=kernels,
        tokens=tokens,
        slots=slot_t,
        kv_lens=lens,
        page_table=page_table,
        rows=kernels.decode_rows(tokens, slot_t, lens, page_table, page_size),
    )


def length_groups(kv_lens: dict[int, int]) -> list[list[int]]:
    """Split rows (row -> KV length) into groups, each in row order, whose padded size stays near
    their real size.

    Longest first; a row joins the current group while the padding (rows x the
    group's longest - the real lengths) stays under half the real size or under
    PAD_FLOOR_TOKENS, where one more call per layer would cost more than the copy.
    """
    groups: list[list[int]] = []
    longest = real = 0
    for row in sorted(kv_lens, key=lambda r: -kv_lens[r]):
        n = kv_lens[row]
        if groups:
            padded = (len(groups[-1]) + 1) * longest
            if padded - (real + n) <= max(real + n, 2 * PAD_FLOOR_TOKENS) // 2:
                groups[-1].append(row)
                real += n
                continue
        groups.append([row])
        longest = real = n
    return [sorted(group) for group in groups]


def kv_locations(
    page_table: torch.Tensor, page_size: int, slots: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """KV slot of each (request slot, position): page_table[s, p // ps] * ps + p % ps."""
    return page_table[slots, positions // page_size] * page_size + positions % page_size


def _decode_group(
    page_table: torch.Tensor, page_size: int, rows: list[tuple[int, int, int]], device: torch.device
) -> DecodeGroup:
    """rows: (request slot, flat token index, KV length)."""
    lens = [n for _, _, n in rows]
    kv_lens = torch.tensor(lens, device=device)
    max_len = max(lens)
    grid = torch.arange(max_len, device=device)[None, :]
    # Padding reads the row's own last position: never unwritten memory (NaN * 0 is NaN).
    positions = torch.minimum(grid, kv_lens[:, None] - 1)
    row_slots = torch.tensor([slot for slot, _, _ in rows], device=device)[:, None]
    locs = kv_locations(page_table, page_size, row_slots, positions).view(-1)
    tokens = torch.tensor([token for _, token, _ in rows], device=device)
    mask = None if min(lens) == max_len else (grid < kv_lens[:, None])[:, None, None, :]
    return DecodeGroup(tokens=tokens, kv_locs=locs, max_len=max_len, mask=mask)


def _extend_row(
    page_table: torch.Tensor,
    page_size: int,
    slot: int,
    start: int,
    prefix_len: int,
    length: int,
    device: torch.device,
) -> ExtendRow:
    if prefix_len == 0:
        return ExtendRow(start=start, length=length, prefix_len=0, kv_locs=None, mask=None)
    kv_len = prefix_len + length
    kv_pos = torch.arange(kv_len, device=device)
    kv_locs = kv_locations(page_table, page_size, torch.tensor(slot, device=device), kv_pos)
    q_pos = torch.arange(prefix_len, kv_len, device=device)
    mask = kv_pos[None, :] <= q_pos[:, None]
    return ExtendRow(start=start, length=length, prefix_len=prefix_len, kv_locs=kv_locs, mask=mask)
