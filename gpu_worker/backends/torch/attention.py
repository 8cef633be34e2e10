"""Attention over the paged KV pool in torch: any device, any dtype (float64 for the exact tests).

Rows come in two kinds, each attended in the cheapest shape torch offers:
- decode rows (one new token): batched calls over groups of rows of similar KV
  length (usually one group). A group's KV is gathered by KV location into
  [rows, max_len], padded, with a length mask (none when all lengths agree).
  Grouping by length bounds the padding: one long row no longer makes every
  short row gather and attend over its length. The query heads of a KV head
  are laid along the "query length" axis, so GQA needs no repeat of K/V.
- extend rows (a prompt or a chunk of one): one call each, queries
  [prefix_len, prefix_len + extend_len) over KV [0, prefix_len + extend_len),
  causal. A row with no prefix reads its fresh K/V directly.

Everything here is built once per batch (``AttentionMetadata``) and shared by
all layers; the per-layer work is a write of the new K/V and the calls above.
A KV pool of another dtype than the activations (``--kv-cache-dtype``) is written
rounded to its dtype and read back as the activations' (a row with no prefix
reads its fresh K/V as computed).
A layer's options (scale, sliding window, soft-capping, sinks) are applied by masks and,
for soft-capping and sinks, by the explicit softmax SDPA cannot do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch
import torch.nn.functional as F

from gpu_worker.forward_context import PLAIN, AttentionOptions

# Extend rows' blocks of mutual attention: an extend row's flat start -> position ranges [lo, hi)
# whose tokens see each other both ways (an image's, for Gemma 3: image_encoder.py).
Blocks = dict[int, tuple[tuple[int, int], ...]]

# Padding a decode group by up to this many KV tokens is cheaper than one more attention call per layer.
PAD_FLOOR_TOKENS = 1024


@dataclass(frozen=True)
class ExtendRow:
    """One extend row: its tokens are ``[start, start + length)`` of the flat batch."""

    start: int
    length: int
    prefix_len: int
    kv_locs: torch.Tensor | None  # [prefix_len + length] KV locations; None when prefix_len == 0
    mask: torch.Tensor | None  # [length, prefix_len + length] bool; None: plain causal


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows of similar KV length, attended in one call."""

    tokens: torch.Tensor  # [B] flat indices of their tokens
    kv_locs: torch.Tensor  # [B * L] KV locations, row-major, padded with a valid one of the same row
    max_len: int  # L
    mask: torch.Tensor | None  # [B, 1, 1, L] bool, True = attend; None: every row has L tokens
    kv_lens: torch.Tensor  # [B] KV tokens of each row, its new one included


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this batch's K/V go and what each row's queries attend to."""

    out_locs: torch.Tensor  # [T] KV location of every new token
    decode: tuple[DecodeGroup, ...]
    extends: tuple[ExtendRow, ...]
    in_order: bool  # every row decodes (tokens are arange(T)), in one group


def attend(
    meta: AttentionMetadata,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    options: AttentionOptions = PLAIN,
    write_kv: bool = True,
    blocks: Blocks | None = None,
) -> torch.Tensor:
    """Write the batch's new K/V (unless the caller did), then attend every row of ``meta``.
    q: [T, Hq, D], k/v: [T, Hkv, D]; rows ``meta`` does not list are left as they are in ``out``.
    ``blocks``: position ranges whose tokens attend to each other both ways (an image's)."""
    if write_kv:  # index_copy_/index_select, not advanced indexing: several times faster on CPU
        store_kv(k_cache, v_cache, k, v, meta.out_locs)
    if meta.in_order and (options is PLAIN or options == PLAIN):
        return _decode_attention(q, k_cache, v_cache, meta.decode[0], options)
    out = torch.empty_like(q)
    attend_into(out, meta, q, k, v, k_cache, v_cache, options, blocks)
    return out


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_locs: torch.Tensor
) -> None:
    """The new K/V [T, Hkv, D] into pool rows ``out_locs``, rounded to the pool's dtype."""
    k_cache.index_copy_(0, out_locs, k.to(k_cache.dtype))
    v_cache.index_copy_(0, out_locs, v.to(v_cache.dtype))


def attend_into(
    out: torch.Tensor,
    meta: AttentionMetadata,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    options: AttentionOptions,
    blocks: Blocks | None = None,
) -> None:
    """``out``'s rows of ``meta``'s decode groups and extend rows, attended (K/V already written)."""
    for group in meta.decode:
        part = _decode_attention(q.index_select(0, group.tokens), k_cache, v_cache, group, options)
        out.index_copy_(0, group.tokens, part)
    for row in meta.extends:
        rows = slice(row.start, row.start + row.length)
        if row.kv_locs is None:
            row_k, row_v = k[rows], v[rows]
        else:
            row_k = k_cache.index_select(0, row.kv_locs).to(q.dtype)
            row_v = v_cache.index_select(0, row.kv_locs).to(q.dtype)
        spans = blocks.get(row.start, ()) if blocks else ()
        out[rows] = _extend_attention(q[rows], row_k, row_v, row, options, spans)


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    options: AttentionOptions,
) -> torch.Tensor:
    rows, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    # [B, L, Hkv, D] -> [B, Hkv, L, D]; the G query heads sharing a KV head act as G queries.
    shape = (rows, group.max_len, kv_heads, head_dim)
    k = k_cache.index_select(0, group.kv_locs).to(q.dtype).view(shape).transpose(1, 2)
    v = v_cache.index_select(0, group.kv_locs).to(q.dtype).view(shape).transpose(1, 2)
    q = q.view(rows, kv_heads, q_heads // kv_heads, head_dim)
    mask = group.mask
    if options.sliding_window > 0:  # the query is at position kv_len - 1
        grid = torch.arange(group.max_len, device=q.device)[None, :]
        seen = grid > group.kv_lens[:, None] - 1 - options.sliding_window
        mask = seen[:, None, None, :] if mask is None else mask & seen[:, None, None, :]
    sinks = None if options.sinks is None else options.sinks.view(kv_heads, q_heads // kv_heads, 1)
    out = _sdpa(q, k, v, mask, False, options, sinks=sinks)
    return out.reshape(rows, q_heads, head_dim)


def _extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    row: ExtendRow,
    options: AttentionOptions,
    spans: tuple[tuple[int, int], ...] = (),
) -> torch.Tensor:
    mask = row.mask
    explicit = options.logit_softcap > 0 or options.sinks is not None
    if options.sliding_window > 0 or (explicit and mask is None) or spans:
        kv_pos = torch.arange(row.prefix_len + row.length, device=q.device)
        q_pos = kv_pos[row.prefix_len :]
        mask = kv_pos[None, :] <= q_pos[:, None]
        for lo, hi in spans:  # causal OR the block, then the window (HF's order)
            mask |= ((q_pos >= lo) & (q_pos < hi))[:, None] & ((kv_pos >= lo) & (kv_pos < hi))[None, :]
        if options.sliding_window > 0:
            mask &= kv_pos[None, :] > q_pos[:, None] - options.sliding_window
    gqa = q.shape[1] != k.shape[1]
    sinks = None if options.sinks is None else options.sinks.view(-1, 1, 1)
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, L, D]
    if sinks is not None:
        return _sdpa(q, k, v, mask, False, options, gqa, sinks).transpose(0, 1)
    if q.dtype in (torch.float32, torch.float64):
        # As a batch of one: torch's fused CPU attention takes only 4-D inputs (on 3-D ones it runs
        # its unfused math, several times slower), 1e-6 from the math in float32. 16-bit dtypes keep
        # the math's bits: the fused kernel rounds the probabilities to 16 bits, enough to turn the
        # embedded model's near-tied first answer token in bfloat16 (docs/benchmarks-history.md,
        # "Q6_K's passes from stored offsets, prefill attention on torch's fused kernel").
        return _sdpa(q[None], k[None], v[None], mask, mask is None, options, gqa)[0].transpose(0, 1)
    return _sdpa(q, k, v, mask, mask is None, options, gqa).transpose(0, 1)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    options: AttentionOptions,
    gqa: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(scale q k^T (soft-capped), masked) v over the last two dims; SDPA where no soft cap
    and no sinks. ``gqa``: q has a multiple of k's heads (dim -3), each K/V head serving a run of them.
    ``sinks``: each query head's sink logit, shaped to broadcast against the scores' [..., 1]."""
    if options.logit_softcap <= 0 and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=options.scale, enable_gqa=gqa
        )
    assert not is_causal, "soft-capping takes an explicit causal mask (None: every position is seen)"
    if gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scale = options.scale if options.scale is not None else 1 / math.sqrt(q.shape[-1])
    cap = options.logit_softcap
    scores = (q @ k.transpose(-1, -2)) * scale
    if cap > 0:
        scores = torch.tanh(scores / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    # The sink's column joins the softmax and is dropped before the values (it has none).
    sink_column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink_column), dim=-1), dim=-1)
    return probs[..., :-1] @ v


def build_metadata(
    page_table: torch.Tensor,
    page_size: int,
    req_pool_idx: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
    device: torch.device,
    kernel_max_extend: int = 0,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions [T] and the attention metadata of one batch, from its O(rows) lists.

    ``kernel_max_extend``: rows of up to that many tokens are left out (a backend's own kernel
    attends them: the CPU's, decode rows and verify rows); their K/V are still written here.
    """
    if kernel_max_extend > 0 and device.type == "cpu" and all(n == 1 for n in extend_lens):
        # Only decode rows, all the kernel's (a steady decode step on the CPU): each row's one position
        # and KV location, read from the page table as numbers (a dozen small torch ops cost more).
        table, pos = page_table.numpy(), np.asarray(prefix_lens, dtype=np.int64)
        locs = table[np.asarray(req_pool_idx), pos // page_size] * page_size + pos % page_size
        positions = torch.from_numpy(pos)
        out_locs = torch.from_numpy(locs.astype(table.dtype, copy=False))
        return positions, AttentionMetadata(out_locs=out_locs, decode=(), extends=(), in_order=False)
    starts = list(accumulate(extend_lens[:-1], initial=0))
    total = starts[-1] + extend_lens[-1]
    lens = torch.tensor(extend_lens, device=device)
    row_of_token = torch.repeat_interleave(
        torch.arange(len(req_pool_idx), device=device), lens, output_size=total
    )
    row_start = torch.tensor(starts, device=device)[row_of_token]
    prefix = torch.tensor(prefix_lens, device=device)
    positions = prefix[row_of_token] + torch.arange(total, device=device) - row_start
    rows_t = torch.tensor(req_pool_idx, device=device)
    out_locs = kv_locations(page_table, page_size, rows_t[row_of_token], positions)

    extends = tuple(
        _extend_row(page_table, page_size, req_pool_idx[i], starts[i], prefix_lens[i], n, device)
        for i, n in enumerate(extend_lens)
        if n > max(kernel_max_extend, 1)
    )
    kv_lens = {i: prefix_lens[i] + 1 for i, n in enumerate(extend_lens) if n == 1}
    all_decode = len(kv_lens) == len(req_pool_idx)  # then the tokens are arange(T)
    decode = tuple(
        _decode_group(page_table, page_size, [(req_pool_idx[i], starts[i], kv_lens[i]) for i in rows], device)
        for rows in (length_groups(kv_lens) if kernel_max_extend == 0 else [])
    )
    in_order = len(decode) == 1 and all_decode
    meta = AttentionMetadata(out_locs=out_locs, decode=decode, extends=extends, in_order=in_order)
    return positions, meta


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
    page_table: torch.Tensor, page_size: int, req_pool_idx: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """KV location of each (page-table row, position): page_table[r, p // ps] * ps + p % ps."""
    return page_table[req_pool_idx, positions // page_size] * page_size + positions % page_size


def _decode_group(
    page_table: torch.Tensor, page_size: int, rows: list[tuple[int, int, int]], device: torch.device
) -> DecodeGroup:
    """rows: (req_pool_idx, flat token index, KV length)."""
    lens = [n for _, _, n in rows]
    kv_lens = torch.tensor(lens, device=device)
    max_len = max(lens)
    grid = torch.arange(max_len, device=device)[None, :]
    # Padding reads the row's own last position: never unwritten memory (NaN * 0 is NaN).
    positions = torch.minimum(grid, kv_lens[:, None] - 1)
    req_pool_idx = torch.tensor([idx for idx, _, _ in rows], device=device)[:, None]
    locs = kv_locations(page_table, page_size, req_pool_idx, positions).view(-1)
    tokens = torch.tensor([token for _, token, _ in rows], device=device)
    mask = None if min(lens) == max_len else (grid < kv_lens[:, None])[:, None, None, :]
    return DecodeGroup(tokens=tokens, kv_locs=locs, max_len=max_len, mask=mask, kv_lens=kv_lens)


def _extend_row(
    page_table: torch.Tensor,
    page_size: int,
    req_pool_idx: int,
    start: int,
    prefix_len: int,
    length: int,
    device: torch.device,
) -> ExtendRow:
    if prefix_len == 0:
        return ExtendRow(start=start, length=length, prefix_len=0, kv_locs=None, mask=None)
    kv_len = prefix_len + length
    kv_pos = torch.arange(kv_len, device=device)
    kv_locs = kv_locations(page_table, page_size, torch.tensor(req_pool_idx, device=device), kv_pos)
    q_pos = torch.arange(prefix_len, kv_len, device=device)
    mask = kv_pos[None, :] <= q_pos[:, None]
    return ExtendRow(start=start, length=length, prefix_len=prefix_len, kv_locs=kv_locs, mask=mask)
