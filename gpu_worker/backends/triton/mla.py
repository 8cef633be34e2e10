"""Latent attention on the Triton backend: LatentAttention's ``pooled_attention`` slot (models/mla.py).

Each layer writes the batch's pool rows, then attends each row in the form ``--latent-attention``
gives it (auto: prompt rows expanded, decode rows absorbed):
- absorbed, mla_decode.py's kernel: q_nope through kv_b's key half, every head over the row's latents
  in the pool, kv_b's value half applied to the attended latents after;
- expanded, the paged attention kernel (attention.py): the rows' latents (prefix and chunk, read back
  from the pool as the backend reads K/V) through kv_b to per-head K and V, laid out one after the
  other with a page table of page size 1. Its K and V share one head dim, so the narrower of
  qk (nope + rope) and v is zero-padded to the wider (DeepSeek's V 128 to K's 192): zero query and
  key dims add nothing to a score, zero value dims are dropped from the output.
"""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from gpu_worker.backends.triton.attention import attention_rows, paged_attention
from gpu_worker.backends.triton.mla_decode import LatentQueries, latent_decode

if TYPE_CHECKING:
    from gpu_worker.backends.triton.backend import TritonMetadata
    from gpu_worker.forward_context import BatchRows, ForwardContext
    from gpu_worker.models.mla import LatentAttention


def pooled_attention(
    attn: LatentAttention,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    entry: torch.Tensor,
    ctx: ForwardContext,
) -> torch.Tensor:
    """Each head's attended values [T, H, v] of the batch's tokens; ``entry`` [T, 1, r + rope] is written to
    the pool first."""
    meta: TritonMetadata = ctx.attn
    rows = ctx.rows
    assert rows is not None, "latent attention reads the batch's rows"
    cache = ctx.k_cache[attn.layer]
    cache.index_copy_(0, meta.out_locs, entry.to(cache.dtype))
    form = ctx.latent_form
    absorbed = [form == "absorbed" or (form == "auto" and n == 1) for n in rows.extend_lens]
    if all(absorbed):
        queries = LatentQueries(meta.token_req_pool_idx, ctx.positions, meta.rows.max_kv_len)
        return _absorbed(attn, q_nope, q_rope, cache, meta, queries)
    if not any(absorbed):
        return _expanded(attn, q_nope, q_rope, cache, rows, list(range(len(absorbed))))
    out = q_nope.new_empty((q_nope.shape[0], attn.num_heads, attn.args.v_dim))
    starts = list(accumulate(rows.extend_lens, initial=0))
    expanded = [i for i, a in enumerate(absorbed) if not a]
    tokens = _tokens_of(expanded, starts, out.device)
    out[tokens] = _expanded(attn, q_nope, q_rope, cache, rows, expanded)
    decode = [i for i, a in enumerate(absorbed) if a]  # one token each (auto's rule)
    tokens = torch.tensor([starts[i] for i in decode], device=out.device)
    queries = LatentQueries(
        meta.token_req_pool_idx[tokens], ctx.positions[tokens], max(rows.prefix_lens[i] + 1 for i in decode)
    )
    out[tokens] = _absorbed(attn, q_nope[tokens], q_rope[tokens], cache, meta, queries)
    return out


def _tokens_of(rows: list[int], starts: list[int], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(starts[i], starts[i + 1], device=device) for i in rows])


def _absorbed(
    attn: LatentAttention,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    meta: TritonMetadata,
    queries: LatentQueries,
) -> torch.Tensor:
    """Queries [Q, H, *] each over its row's latents up to its position: [Q, H, v]."""
    q_lat = attn.kv_b_proj.absorb_query(q_nope)
    q_rope = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
    attended = q_lat.new_empty(q_lat.shape)
    latent_decode(q_lat, q_rope, cache, attended, meta.page_table, meta.page_size, queries, attn.args.scale)
    return attn.kv_b_proj.values(attended)


def _expanded(
    attn: LatentAttention,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    rows: BatchRows,
    which: list[int],
) -> torch.Tensor:
    """Rows ``which`` of the batch over per-head K/V expanded from their latents: [their tokens, H, v]."""
    a, device = attn.args, q_nope.device
    prefixes = [rows.prefix_lens[i] for i in which]
    extends = [rows.extend_lens[i] for i in which]
    kv_lens = [p + n for p, n in zip(prefixes, extends, strict=True)]
    latents = cache.index_select(0, _pool_locations(rows, which, kv_lens, device))[:, 0].to(q_nope.dtype)
    k_nope, v = attn.kv_b_proj.expand(latents[:, : a.kv_lora_rank])
    k_rope = latents[:, None, a.kv_lora_rank :].expand(-1, attn.num_heads, a.rope_dim)
    dim = max(a.nope_dim + a.rope_dim, a.v_dim)
    if len(which) < len(rows.extend_lens):
        tokens = _tokens_of(which, list(accumulate(rows.extend_lens, initial=0)), device)
        q_nope, q_rope = q_nope[tokens], q_rope[tokens]
    q = _padded(torch.cat((q_nope, q_rope), dim=-1), dim)
    k, v = _padded(torch.cat((k_nope, k_rope), dim=-1), dim), _padded(v, dim)
    # Row j's K/V are rows offsets[j]..offsets[j + 1] of k and v: a page table of page size 1.
    offsets = torch.tensor(list(accumulate(kv_lens, initial=0))[:-1], device=device)
    table = offsets[:, None] + torch.arange(max(kv_lens), device=device)[None, :]
    out = torch.empty_like(q)
    batch = attention_rows(list(range(len(which))), prefixes, extends, device)
    paged_attention(q, k, v, out, table, 1, batch, a.scale)
    return out[..., : a.v_dim]


def _padded(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x if x.shape[-1] == dim else F.pad(x, (0, dim - x.shape[-1]))


def _pool_locations(
    rows: BatchRows, which: list[int], kv_lens: list[int], device: torch.device
) -> torch.Tensor:
    """The pool rows of positions 0..kv_len - 1 of each of rows ``which``, one after the other."""
    lens = torch.tensor(kv_lens, device=device)
    pool_idx = torch.tensor([rows.req_pool_idx[i] for i in which], device=device).repeat_interleave(lens)
    positions = torch.cat([torch.arange(n, device=device) for n in kv_lens])
    ps = rows.page_size
    return rows.page_table[pool_idx, positions // ps] * ps + positions % ps
