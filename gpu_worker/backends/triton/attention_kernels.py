"""The Triton kernels of paged attention; ``attention.py`` sizes and launches them.

One unified kernel serves decode, extend and mixed batches. A program takes one q-block (up to
BLOCK_Q consecutive query tokens of one batch row) and one KV head, and stacks the GROUP query heads
that share that KV head under each token, so its BLOCK_M = BLOCK_Q * GROUP query rows load every K/V
tile once (vLLM's unified attention does the same). Each K/V token is found through the page table on
its own, so any page size works and a prefix may end mid-page.

A third grid axis splits the KV range into segments (flash decoding): each segment writes its
unnormalized output with its running max and sum, and ``_merge_segments_kernel`` combines them.

All math is fp32: 16-bit Q/K/V are cast right after loading. That is also what Triton's interpreter
needs (it computes bf16 arithmetic on raw bits). Scores live in the log2 domain so the kernel uses exp2.
"""

from __future__ import annotations

from gpu_worker.backends.triton.interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported: see interpreter.py

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
# The running max starts finite: a query row that has seen only masked scores then gets
# exp2(-inf - NO_SCORE) = 0 instead of exp2(-inf + inf) = NaN.
NO_SCORE: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _tanh(x):
    # tl has no tanh; this form never overflows: exp2 of a non-positive number.
    t = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    magnitude = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -magnitude, magnitude)


@triton.jit
def _find_row(q_starts_ptr, num_rows, q_block, BLOCK_Q: tl.constexpr):
    # Row r owns q-blocks [q_starts[r] // BLOCK_Q + r, q_starts[r + 1] // BLOCK_Q + r + 1): enough for
    # its cdiv(extend_len, BLOCK_Q) blocks, the surplus exits at once. The first block of each row
    # strictly increases with r, so a binary search finds the last row starting at or before q_block.
    # Annotated so both stay int32 tensors through the loop (num_rows == 1 arrives as a constexpr).
    lo: tl.int32 = 0
    hi: tl.int32 = num_rows - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        starts_before = tl.load(q_starts_ptr + mid) // BLOCK_Q + mid <= q_block
        lo = tl.where(starts_before, mid, lo)
        hi = tl.where(starts_before, hi, mid - 1)
    return lo


@triton.jit
def _attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    page_table_ptr,
    req_pool_idx_ptr,
    q_starts_ptr,
    prefix_lens_ptr,
    part_out_ptr,  # [T, Hq, NUM_SEGMENTS, HEAD_DIM] fp32, used only when NUM_SEGMENTS > 1
    part_max_ptr,  # [T, Hq, NUM_SEGMENTS] fp32 (log2 domain)
    part_sum_ptr,  # [T, Hq, NUM_SEGMENTS] fp32
    sinks_ptr,  # [Hq] fp32 sink logits, read only with USE_SINKS
    num_rows,
    num_q_heads,
    scale,
    softcap,
    sliding_window,  # the host passes a window longer than any context when there is none
    tiles_per_segment,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_pt,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    row = _find_row(q_starts_ptr, num_rows, q_block, BLOCK_Q)
    q_start = tl.load(q_starts_ptr + row)
    q_len = tl.load(q_starts_ptr + row + 1) - q_start
    first_q = (q_block - (q_start // BLOCK_Q + row)) * BLOCK_Q
    if first_q >= q_len:
        return
    prefix_len = tl.load(prefix_lens_ptr + row)
    page_row = page_table_ptr + tl.load(req_pool_idx_ptr + row).to(tl.int64) * stride_pt

    # Query row m of the tile is token first_q + m // GROUP, query head kv_head * GROUP + m % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    tok = first_q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    m_valid = (offs_m // GROUP < BLOCK_Q) & (tok < q_len) & (head < num_q_heads)
    q_pos = prefix_len + tok
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q_mask = m_valid[:, None] & d_valid[None, :]
    q_offs = q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0).to(tl.float32)

    # The KV tiles this q-block needs: causal end of its last query, window start of its first.
    kv_end = prefix_len + tl.minimum(first_q + BLOCK_Q, q_len)
    kv_begin = tl.maximum(prefix_len + first_q - sliding_window + 1, 0)
    tile_lo = kv_begin // BLOCK_N
    tile_hi = tl.cdiv(kv_end, BLOCK_N)
    if NUM_SEGMENTS > 1:
        tile_lo = tl.maximum(tile_lo, segment * tiles_per_segment)
        tile_hi = tl.minimum(tile_hi, (segment + 1) * tiles_per_segment)

    row_max = tl.full([BLOCK_M], NO_SCORE, tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for tile in range(tile_lo, tile_hi):
        kv_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_valid = kv_pos < kv_end
        page = tl.load(page_row + kv_pos // PAGE_SIZE, mask=n_valid, other=0)
        loc = page * PAGE_SIZE + kv_pos % PAGE_SIZE
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k_offs = loc[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
        k = tl.load(k_cache_ptr + k_offs, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if USE_SOFTCAP:
            scores = softcap * _tanh(scores / softcap)
        visible = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] > q_pos[:, None] - sliding_window)
        scores = tl.where(visible & n_valid[None, :], scores * LOG2E, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        probs = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        v_offs = loc[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
        v = tl.load(v_cache_ptr + v_offs, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(probs, v, input_precision=DOT_PRECISION)
        row_max = new_max

    if NUM_SEGMENTS == 1:
        if USE_SINKS:  # the sink's term joins the sum: a weight with no value
            sink = tl.load(sinks_ptr + head, mask=m_valid, other=0.0) * LOG2E
            row_sum += tl.exp2(sink - row_max)
        # Rows outside the block have a zero sum; they are not stored, the guard only avoids 0/0.
        out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
        out_offs = q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # An empty segment stores max NO_SCORE and sum 0: the merge weighs it by exp2(NO_SCORE - max) = 0.
        part = (q_rows * num_q_heads + head) * NUM_SEGMENTS + segment
        tl.store(part_max_ptr + part, row_max, mask=m_valid)
        tl.store(part_sum_ptr + part, row_sum, mask=m_valid)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)


@triton.jit
def _merge_segments_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    sinks_ptr,
    num_q_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    # One program per (token, query head): rescale each segment to the common max and normalize once.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    segs = tl.arange(0, BLOCK_S)
    s_valid = segs < NUM_SEGMENTS
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    part = (token * num_q_heads + head) * NUM_SEGMENTS + segs
    seg_max = tl.load(part_max_ptr + part, mask=s_valid, other=NO_SCORE)
    seg_sum = tl.load(part_sum_ptr + part, mask=s_valid, other=0.0)
    seg_out_mask = s_valid[:, None] & d_valid[None, :]
    seg_out = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=seg_out_mask, other=0.0)
    top = tl.max(seg_max, 0)
    weight = tl.exp2(seg_max - top)
    total = tl.sum(seg_sum * weight, 0)
    if USE_SINKS:  # the sink's term joins the sum once, at the common max
        total += tl.exp2(tl.load(sinks_ptr + head) * LOG2E - top)
    out = tl.sum(seg_out * weight[:, None], 0) / total
    out_offs = token * stride_ot + head * stride_oh + offs_d
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=d_valid)
