"""Latent attention row by row, in torch, over the latent pool (mla.py's forms, for a batch with
prompt rows or under ``--latent-attention expanded``).

The batch's pool rows are written first (rounded to the pool's dtype); each row then reads its
latents: a row without a prefix its own as computed, others from the pool (as the torch backend reads
K/V). A prompt row, or every row under ``expand_all``, is attended in the expanded form; a decode row
(one token) in the absorbed one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from gpu_worker.forward_context import BatchRows, ForwardContext
    from gpu_worker.models.mla import LatentAttention


def pool_locations(rows: BatchRows, row: int, positions: torch.Tensor) -> torch.Tensor:
    """Pool rows of row ``row``'s ``positions``: page_table[r, p // ps] * ps + p % ps."""
    ps = rows.page_size
    pages = rows.page_table[rows.req_pool_idx[row]].index_select(0, positions // ps)
    return pages * ps + positions % ps


def attend_rows(
    attn: LatentAttention,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    entry: torch.Tensor,
    ctx: ForwardContext,
    expand_all: bool,
) -> torch.Tensor:
    """Each head's attended values [T, H, v] of the batch's rows (the pool written here)."""
    rows = ctx.rows
    assert rows is not None, "the row-by-row forms read the batch's rows"
    cache = ctx.k_cache[attn.layer]
    device = q_nope.device
    starts = [0]
    for n in rows.extend_lens:
        starts.append(starts[-1] + n)
    locs = [
        pool_locations(rows, i, torch.arange(p, p + n, device=device))
        for i, (p, n) in enumerate(zip(rows.prefix_lens, rows.extend_lens, strict=True))
    ]
    cache.index_copy_(0, torch.cat(locs), entry.to(cache.dtype))
    out = q_nope.new_empty((q_nope.shape[0], attn.num_heads, attn.args.v_dim))
    for i, (prefix, n) in enumerate(zip(rows.prefix_lens, rows.extend_lens, strict=True)):
        span = slice(starts[i], starts[i] + n)
        if prefix == 0:
            latents = entry[span, 0]
        else:
            every = pool_locations(rows, i, torch.arange(prefix + n, device=device))
            latents = cache.index_select(0, every)[:, 0].to(q_nope.dtype)
        if n > 1 or expand_all:
            out[span] = _expanded(attn, q_nope[span], q_rope[span], latents, prefix)
        else:
            out[span] = _absorbed(attn, q_nope[span], q_rope[span], latents)
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
    attn: LatentAttention, q_nope: torch.Tensor, q_rope: torch.Tensor, latents: torch.Tensor
) -> torch.Tensor:
    """One query [1, H, *] at the last of ``latents`` [L, r + rope], attended over the latents."""
    a = attn.args
    q = torch.cat((attn.kv_b_proj.absorb_query(q_nope), q_rope), dim=-1)  # [1, H, r + rope]
    scores = torch.einsum("hd,ld->hl", q[0], latents) * a.scale
    attended = torch.softmax(scores, dim=-1) @ latents[:, : a.kv_lora_rank]
    return attn.kv_b_proj.values(attended[None])
