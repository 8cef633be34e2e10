"""Latent attention's absorbed decode over the latent pool: sizes and launches mla_kernels.py's kernel.

Split-K as the paged attention decides it (attention.py): a batch too small to fill the GPU splits
each query's positions over segments, merged by attention_kernels' ``_merge_segments_kernel``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from gpu_worker.backends.triton.attention import MAX_SEGMENTS, MIN_SEGMENT_TOKENS, TARGET_PROGRAMS
from gpu_worker.backends.triton.attention_kernels import _merge_segments_kernel
from gpu_worker.backends.triton.mla_kernels import _latent_decode_kernel

BLOCK_H = 16  # heads per program: tl.dot's smallest M on NVIDIA; fewer heads are masked padding


@dataclass(frozen=True)
class LatentQueries:
    """The queries of one launch: query q reads pool rows of page-table row ``pool_idx[q]`` at positions
    ``0..positions[q]``."""

    pool_idx: torch.Tensor  # int32 [Q]
    positions: torch.Tensor  # int32 [Q]
    max_kv_len: int  # the longest query's positions + 1: the host's sizing of the split


@dataclass(frozen=True)
class _Tiles:
    block_r: int
    block_p: int
    block_n: int
    num_warps: int


def _tiles(kv_rank: int, rope_dim: int, fp32: bool) -> _Tiles:
    # The q, acc and latent tiles are [BLOCK_H, BLOCK_R], [BLOCK_H, BLOCK_R] and [BLOCK_N, BLOCK_R] fp32;
    # with DeepSeek's 512 a narrower latent tile keeps them in registers and shared memory (checked in
    # the compiled kernels' resource usage, tests/gpu_worker/backends/compile_for_gpu.py).
    block_r = max(16, triton.next_power_of_2(kv_rank))
    block_p = max(16, triton.next_power_of_2(rope_dim))
    block_n = 16 if block_r >= 256 or fp32 else 32  # fp32's exact dot runs on FMA units: half the tile
    return _Tiles(block_r, block_p, block_n, num_warps=8 if block_r >= 256 else 4)


def _num_segments(queries: int, head_blocks: int, max_kv_len: int, block_n: int) -> tuple[int, int]:
    """(segments, KV tiles per segment): split only when the queries' programs are too few to fill the GPU."""
    total_tiles = triton.cdiv(max_kv_len, block_n)
    programs = queries * head_blocks
    if programs >= TARGET_PROGRAMS:
        return 1, total_tiles
    wanted = min(triton.cdiv(TARGET_PROGRAMS, programs), max_kv_len // MIN_SEGMENT_TOKENS, MAX_SEGMENTS)
    tiles_per_segment = triton.cdiv(total_tiles, max(wanted, 1))
    return triton.cdiv(total_tiles, tiles_per_segment), tiles_per_segment


def latent_decode(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    out: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    queries: LatentQueries,
    scale: float,
) -> None:
    """softmax(scale * (q_lat . c + q_rope . k_rope)) . c for every query and head, into ``out`` in place.

    ``q_lat``/``out``: ``[Q, H, kv_rank]``; ``q_rope``: ``[Q, H, rope_dim]``; ``cache``: the latent pool,
    ``[rows, 1, kv_rank + rope_dim]``, rows contiguous. Math is fp32 whatever the dtypes; the last dim of
    q and out must be contiguous, their other strides are free.
    """
    num_queries, num_heads, kv_rank = q_lat.shape
    rope_dim = q_rope.shape[2]
    assert out.shape == q_lat.shape and q_rope.shape[:2] == q_lat.shape[:2], "q_lat, q_rope and out disagree"
    assert cache.shape[1:] == (1, kv_rank + rope_dim) and cache.stride(2) == 1, "the pool rows do not fit q"
    assert page_table.dtype == torch.int64 and page_table.stride(1) == 1, "page_table: int64, rows contiguous"
    assert all(t.stride(-1) == 1 for t in (q_lat, q_rope, out)), "the head dim must be contiguous"
    assert queries.pool_idx.shape == queries.positions.shape == (num_queries,)
    fp32 = torch.float32 in (q_lat.dtype, cache.dtype)
    tiles = _tiles(kv_rank, rope_dim, fp32)
    head_blocks = triton.cdiv(num_heads, BLOCK_H)
    segments, tiles_per_segment = _num_segments(num_queries, head_blocks, queries.max_kv_len, tiles.block_n)
    partials = [out] * 3  # placeholders: the one-segment kernel never touches them
    if segments > 1:
        shape = (num_queries, num_heads, segments)
        partials = [torch.empty((*shape, kv_rank), dtype=torch.float32, device=out.device)]
        partials += [torch.empty(shape, dtype=torch.float32, device=out.device) for _ in range(2)]
    _latent_decode_kernel[(num_queries, head_blocks, segments)](
        q_lat, q_rope, cache, out, page_table, queries.pool_idx, queries.positions, *partials,
        num_heads, scale, tiles_per_segment,
        *q_lat.stride()[:2], *q_rope.stride()[:2], *out.stride()[:2], cache.stride(0), page_table.stride(0),
        KV_RANK=kv_rank,
        ROPE_DIM=rope_dim,
        BLOCK_R=tiles.block_r,
        BLOCK_P=tiles.block_p,
        BLOCK_H=BLOCK_H,
        BLOCK_N=tiles.block_n,
        PAGE_SIZE=page_size,
        NUM_SEGMENTS=segments,
        DOT_PRECISION="ieee" if fp32 else "tf32",
        num_warps=tiles.num_warps,
    )  # fmt: skip
    if segments > 1:
        _merge_segments_kernel[(num_queries, num_heads)](
            out, *partials, out, num_heads, *out.stride()[:2],
            HEAD_DIM=kv_rank,
            BLOCK_D=tiles.block_r,
            NUM_SEGMENTS=segments,
            BLOCK_S=triton.next_power_of_2(segments),
            USE_SINKS=False,
        )  # fmt: skip
