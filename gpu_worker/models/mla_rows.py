"""Latent attention row by row, in torch, over the latent pool (mla.py's forms, for a batch with
prompt rows or under ``--latent-attention expanded``).

``RowPlan`` is built once a batch (the model's forward) and read by every layer: each token's pool
row, the rows attended in the expanded form with their latents' pool rows, and the decode rows
attended together in the absorbed form (their latents gathered padded to the longest, as the torch
backend's decode groups are). Each layer writes the batch's latent rows first (rounded to the pool's
dtype); a row without a prefix then reads its own latents as computed (a float8 pool's: rounded as
stored, kv_cache.py), the others from the pool (as the torch backend reads K/V).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from gpu_worker.kv_cache import as_stored, store_rows

if TYPE_CHECKING:
    from gpu_worker.forward_context import BatchRows
    from gpu_worker.models.mla import LatentAttention


@dataclass(frozen=True)
class ExpandedRow:
    start: int  # its first token in the batch
    length: int
    prefix: int  # positions before its first token
    kv_locs: torch.Tensor | None  # [prefix + length] pool rows; None: no prefix (its latents as computed)


@dataclass(frozen=True)
class DecodeGroup:
    tokens: torch.Tensor  # [B] the decode rows' tokens in the batch
    kv_locs: torch.Tensor  # [B * longest] pool rows, a short row's padding its own last position
    mask: torch.Tensor | None  # [B, 1, longest] positions each row sees; None: all of them
    longest: int


@dataclass(frozen=True)
class RowPlan:
    out_locs: torch.Tensor  # [T] the pool row each token's latent is written to
    expanded: tuple[ExpandedRow, ...]
    decode: DecodeGroup | None


def _locations(rows: BatchRows, req_pool_idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    ps = rows.page_size
    return rows.page_table[req_pool_idx, positions // ps] * ps + positions % ps


def plan_rows(rows: BatchRows, expand_all: bool, device: torch.device) -> RowPlan:
    """The batch's plan: rows of more than one token (every row under ``expand_all``) expanded, the
    others decoded absorbed."""
    starts = list(accumulate(rows.extend_lens, initial=0))
    row_of_token = torch.repeat_interleave(
        torch.tensor(rows.req_pool_idx, device=device), torch.tensor(rows.extend_lens, device=device)
    )
    positions = torch.cat(
        [
            torch.arange(p, p + n, device=device)
            for p, n in zip(rows.prefix_lens, rows.extend_lens, strict=True)
        ]
    )
    expanded, decode = [], []
    for i, (prefix, n) in enumerate(zip(rows.prefix_lens, rows.extend_lens, strict=True)):
        if n > 1 or expand_all:
            every = torch.arange(prefix + n, device=device)
            locs = (
                _locations(rows, torch.tensor(rows.req_pool_idx[i], device=device), every) if prefix else None
            )
            expanded.append(ExpandedRow(starts[i], n, prefix, locs))
        else:
            decode.append(i)
    return RowPlan(
        out_locs=_locations(rows, row_of_token, positions),
        expanded=tuple(expanded),
        decode=_decode_group(rows, decode, starts, device) if decode else None,
    )


def _decode_group(rows: BatchRows, decode: list[int], starts: list[int], device: torch.device) -> DecodeGroup:
    lens = torch.tensor([rows.prefix_lens[i] + 1 for i in decode], device=device)
    longest = int(lens.max())
    grid = torch.arange(longest, device=device)[None, :]
    positions = torch.minimum(grid, lens[:, None] - 1)  # padding reads a real row: never NaN * 0
    req_pool_idx = torch.tensor([rows.req_pool_idx[i] for i in decode], device=device)[:, None]
    mask = None if int(lens.min()) == longest else (grid < lens[:, None])[:, None, :]
    return DecodeGroup(
        tokens=torch.tensor([starts[i] for i in decode], device=device),
        kv_locs=_locations(rows, req_pool_idx, positions).flatten(),
        mask=mask,
        longest=longest,
    )


def attend_rows(
    attn: LatentAttention,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    entry: torch.Tensor,
    cache: torch.Tensor,
    plan: RowPlan,
) -> torch.Tensor:
    """Each head's attended values [T, H, v] of the batch's rows (the pool written here)."""
    store_rows(cache, plan.out_locs, entry)
    own = as_stored(entry, cache.dtype)  # a float8 pool's rounding, as a prefix's latents have it
    out = q_nope.new_empty((q_nope.shape[0], attn.num_heads, attn.args.v_dim))
    for row in plan.expanded:
        span = slice(row.start, row.start + row.length)
        if row.kv_locs is None:
            latents = own[span, 0]
        else:
            latents = cache.index_select(0, row.kv_locs)[:, 0].to(q_nope.dtype)
        out[span] = _expanded(attn, q_nope[span], q_rope[span], latents, row.prefix)
    if plan.decode is not None:
        group = plan.decode
        out.index_copy_(0, group.tokens, _absorbed(attn, q_nope, q_rope, cache, group))
    return out


def _expanded(
    attn: LatentAttention, q_nope: torch.Tensor, q_rope: torch.Tensor, latents: torch.Tensor, prefix: int
) -> torch.Tensor:
    """Queries [n, H, *] at positions [prefix, prefix + n) over per-head K/V expanded from ``latents``
    [prefix + n, r + rope]."""
    a = attn.args
    k_nope, v = attn.kv_b_proj.expand(latents[:, : a.kv_lora_rank])
    kv_len, heads = latents.shape[0], attn.num_heads
    k_rope = latents[:, None, a.kv_lora_rank :].expand(kv_len, heads, a.rope_dim)
    k = torch.cat((k_nope, k_rope), dim=-1)
    q = torch.cat((q_nope, q_rope), dim=-1)
    mask = None
    if prefix > 0:
        kv_pos = torch.arange(kv_len, device=q.device)
        mask = kv_pos[None, :] <= kv_pos[prefix:, None]
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, L, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=a.scale)
    return out[0].transpose(0, 1)


def _absorbed(
    attn: LatentAttention, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, group: DecodeGroup
) -> torch.Tensor:
    """The decode rows' queries [B, H, *], each over its latents in the pool: [B, H, v]."""
    a, rows = attn.args, group.tokens.shape[0]
    q = torch.cat((attn.kv_b_proj.absorb_query(q_nope[group.tokens]), q_rope[group.tokens]), dim=-1)
    latents = cache.index_select(0, group.kv_locs).view(rows, group.longest, -1).to(q.dtype)
    scores = torch.einsum("bhd,bld->bhl", q, latents) * a.scale
    if group.mask is not None:
        scores = scores.masked_fill(~group.mask, float("-inf"))
    attended = torch.softmax(scores, dim=-1) @ latents[..., : a.kv_lora_rank]
    return attn.kv_b_proj.values(attended)
