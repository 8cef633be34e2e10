"""Latent attention's absorbed decode as a Triton kernel over the latent pool (models/mla.py).

Every head of a query reads the same pool row a position: ``[c, k_rope]``, the latent (``KV_RANK``)
and the rope key (``ROPE_DIM``). So a program takes one query token and a block of its heads, loads
each latent tile once for all of them, and scores ``q_lat . c + q_rope . k_rope`` as two dots whose
widths are each a power of two (576 = 512 + 64 would pad to 1024 as one head dim). The value is the
latent itself: the output stays in latent space, [heads, KV_RANK], and kv_b's value half is applied
after, by the caller (as the CPU's csrc/mla.c leaves it).

Query q sees positions ``0..positions[q]`` of the row ``pool_idx[q]`` indexes in the page table, so
one launch serves decode rows and, under ``--latent-attention absorbed``, a prompt's tokens too.
Long contexts split over programs as the paged attention's do (flash decoding): each segment writes
its unnormalized output, running max and sum, and attention_kernels' merge combines them.

All math is fp32; scores in the log2 domain (exp2), as in attention_kernels.py.
"""

from __future__ import annotations

from gpu_worker.backends.triton.interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported: see interpreter.py

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from gpu_worker.backends.triton.attention_kernels import LOG2E, NO_SCORE  # noqa: E402


@triton.jit
def _latent_decode_kernel(
    q_lat_ptr,  # [Q, H, KV_RANK]: q_nope absorbed through kv_b's key half
    q_rope_ptr,  # [Q, H, ROPE_DIM]
    cache_ptr,  # [pool rows, 1, KV_RANK + ROPE_DIM]
    out_ptr,  # [Q, H, KV_RANK]
    page_table_ptr,
    pool_idx_ptr,  # int32 [Q]
    positions_ptr,  # int32 [Q]
    part_out_ptr,  # [Q, H, NUM_SEGMENTS, KV_RANK] fp32, used only when NUM_SEGMENTS > 1
    part_max_ptr,  # [Q, H, NUM_SEGMENTS] fp32 (log2 domain)
    part_sum_ptr,  # [Q, H, NUM_SEGMENTS] fp32
    num_heads,
    scale,
    tiles_per_segment,
    stride_lq,
    stride_lh,
    stride_rq,
    stride_rh,
    stride_ot,
    stride_oh,
    stride_ct,
    stride_pt,
    KV_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    query = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    segment = tl.program_id(2)
    kv_len = tl.load(positions_ptr + query) + 1
    page_row = page_table_ptr + tl.load(pool_idx_ptr + query).to(tl.int64) * stride_pt

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_valid = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    r_valid = offs_r < KV_RANK
    offs_p = tl.arange(0, BLOCK_P)
    p_valid = offs_p < ROPE_DIM
    lat_mask = h_valid[:, None] & r_valid[None, :]
    lat_offs = query * stride_lq + heads[:, None] * stride_lh + offs_r[None, :]
    q_lat = tl.load(q_lat_ptr + lat_offs, mask=lat_mask, other=0.0).to(tl.float32)
    rope_offs = query * stride_rq + heads[:, None] * stride_rh + offs_p[None, :]
    q_rope = tl.load(q_rope_ptr + rope_offs, mask=h_valid[:, None] & p_valid[None, :], other=0.0)
    q_rope = q_rope.to(tl.float32)

    tile_lo = 0
    tile_hi = tl.cdiv(kv_len, BLOCK_N)
    if NUM_SEGMENTS > 1:
        tile_lo = segment * tiles_per_segment
        tile_hi = tl.minimum(tile_hi, (segment + 1) * tiles_per_segment)

    row_max = tl.full([BLOCK_H], NO_SCORE, tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for tile in range(tile_lo, tile_hi):
        kv_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_valid = kv_pos < kv_len
        page = tl.load(page_row + kv_pos // PAGE_SIZE, mask=n_valid, other=0)
        row = (page * PAGE_SIZE + kv_pos % PAGE_SIZE) * stride_ct
        latent = tl.load(
            cache_ptr + row[:, None] + offs_r[None, :], mask=n_valid[:, None] & r_valid[None, :], other=0.0
        ).to(tl.float32)
        k_rope = tl.load(
            cache_ptr + row[:, None] + KV_RANK + offs_p[None, :],
            mask=n_valid[:, None] & p_valid[None, :],
            other=0.0,
        ).to(tl.float32)
        scores = tl.dot(q_lat, tl.trans(latent), input_precision=DOT_PRECISION)
        scores += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
        scores = tl.where(n_valid[None, :], scores * (scale * LOG2E), float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        probs = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        acc = acc * rescale[:, None] + tl.dot(probs, latent, input_precision=DOT_PRECISION)
        row_max = new_max

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]  # padding heads: no 0/0
        out_offs = query * stride_ot + heads[:, None] * stride_oh + offs_r[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=lat_mask)
    else:
        # An empty segment stores max NO_SCORE and sum 0: the merge weighs it by 0.
        part = (query * num_heads + heads) * NUM_SEGMENTS + segment
        tl.store(part_max_ptr + part, row_max, mask=h_valid)
        tl.store(part_sum_ptr + part, row_sum, mask=h_valid)
        tl.store(part_out_ptr + part[:, None] * KV_RANK + offs_r[None, :], acc, mask=lat_mask)
