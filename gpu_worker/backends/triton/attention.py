"""Paged attention over the KV pool for any batch of decode and extend rows, in one or two launches.

The kernels are in ``attention_kernels.py``; this module describes the batch (``AttentionRows``, built
once per forward and shared by every layer), picks tile sizes from the head dim, GQA group and dtype,
and decides whether to split long KV ranges across programs (flash decoding).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import triton

from gpu_worker.backends.triton.attention_kernels import _attention_kernel, _merge_segments_kernel

# A batch whose rows have at most this many new tokens is decode-like: small q-blocks, and its KV
# ranges may be split across programs.
DECODE_LIKE_TOKENS = 16
# Split the KV range until about this many programs run: two per SM of an H100 (132 SMs).
TARGET_PROGRAMS = 264
MIN_SEGMENT_TOKENS = 256  # a shorter segment costs more in the merge than it gains
MAX_SEGMENTS = 16
NO_WINDOW = 1 << 30  # a window longer than any context: the kernel then masks nothing by it


@dataclass(frozen=True)
class AttentionRows:
    """A batch's rows as the attention kernel reads them: device tensors plus the host ints of the grid.

    Row r's queries are tokens ``q_starts[r]:q_starts[r + 1]`` of the flat batch, at positions
    ``prefix_lens[r] + i``, and its KV is found through ``page_table[req_pool_idx[r]]``.
    """

    req_pool_idx: torch.Tensor  # int32 [R]
    q_starts: torch.Tensor  # int32 [R + 1], q_starts[R] == T
    prefix_lens: torch.Tensor  # int32 [R]
    num_tokens: int  # T
    max_extend_len: int
    max_kv_len: int

    @property
    def num_rows(self) -> int:
        """R, the number of batch rows."""
        return self.req_pool_idx.shape[0]


def attention_rows(
    req_pool_idx: list[int], prefix_lens: list[int], extend_lens: list[int], device: torch.device | str
) -> AttentionRows:
    """Describe a batch for ``paged_attention``: one host-to-device copy for the three index tensors."""
    num_rows = len(req_pool_idx)
    assert num_rows > 0 and len(prefix_lens) == len(extend_lens) == num_rows, "one entry per row, R > 0"
    assert min(extend_lens) >= 1 and min(prefix_lens) >= 0, "every row has a new token"
    q_starts = [0, *accumulate(extend_lens)]
    packed = torch.tensor([*req_pool_idx, *q_starts, *prefix_lens], dtype=torch.int32, device=device)
    return AttentionRows(
        req_pool_idx=packed[:num_rows],
        q_starts=packed[num_rows : 2 * num_rows + 1],
        prefix_lens=packed[2 * num_rows + 1 :],
        num_tokens=q_starts[-1],
        max_extend_len=max(extend_lens),
        max_kv_len=max(p + e for p, e in zip(prefix_lens, extend_lens, strict=True)),
    )


@dataclass(frozen=True)
class _Tiles:
    block_m: int  # query rows per program: block_q tokens times the GQA group
    block_q: int
    block_n: int  # KV tokens per loop step
    block_d: int  # the head dim padded to a power of two
    num_warps: int


def _tiles(head_dim: int, group: int, max_extend_len: int, fp32: bool) -> _Tiles:
    # Sized so that the fp32 q, acc and K/V tiles stay in registers without spilling on sm_80/sm_90
    # (checked in the compiled kernels' resource usage); tl.dot needs every dim >= 16 on NVIDIA.
    # fp32 halves the KV tile: its exact ("ieee") dot runs on FMA units with operands in registers.
    # Decode-like batches take the smallest M: their blocks hold one token, the rest of M is padding.
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = (64 if block_d <= 64 else 32) // (2 if fp32 else 1)
    if max_extend_len <= DECODE_LIKE_TOKENS:
        block_m = 16
    else:
        block_m = 32 if fp32 or block_d > 128 else 64
    block_m = max(block_m, triton.next_power_of_2(group))
    num_warps = 8 if block_m * block_d >= 4096 else 4
    return _Tiles(block_m, block_q=block_m // group, block_n=block_n, block_d=block_d, num_warps=num_warps)


def _num_segments(rows: AttentionRows, programs: int, block_n: int) -> tuple[int, int]:
    """(segments, KV tiles per segment): split only decode-like batches too small to fill the GPU."""
    total_tiles = triton.cdiv(rows.max_kv_len, block_n)
    if rows.max_extend_len > DECODE_LIKE_TOKENS or programs >= TARGET_PROGRAMS:
        return 1, total_tiles
    wanted = min(triton.cdiv(TARGET_PROGRAMS, programs), rows.max_kv_len // MIN_SEGMENT_TOKENS, MAX_SEGMENTS)
    tiles_per_segment = triton.cdiv(total_tiles, max(wanted, 1))
    return triton.cdiv(total_tiles, tiles_per_segment), tiles_per_segment


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    rows: AttentionRows,
    scale: float,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Causal attention of every row's queries over its paged KV, written into ``out`` in place.

    ``q``/``out``: ``[T, Hq, D]``; ``k_cache``/``v_cache``: ``[pages * page_size, Hkv, D]``; ``page_table``:
    int64 ``[max_requests, pages_per_request]``. Hq is a multiple of Hkv (GQA). ``sliding_window > 0``: a
    query at position p sees KV positions > p - sliding_window; ``logit_softcap > 0``: scores become
    ``softcap * tanh(scores / softcap)`` after scaling; ``sinks`` ([Hq] logits): one more term in each
    head's softmax, with no value (gpt-oss's). Math is fp32 whatever the dtypes; the last dim of
    every tensor and the page table's rows must be contiguous, other strides are free.
    """
    _check_args(q, k_cache, v_cache, out, page_table, rows)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    fp32 = torch.float32 in (q.dtype, k_cache.dtype)
    tiles = _tiles(head_dim, num_q_heads // num_kv_heads, rows.max_extend_len, fp32)
    # Row r owns q_starts[r + 1] // block_q - q_starts[r] // block_q + 1 blocks (see _find_row).
    num_q_blocks = num_tokens // tiles.block_q + rows.num_rows
    segments, tiles_per_segment = _num_segments(rows, num_q_blocks * num_kv_heads, tiles.block_n)
    # Per (token, query head, segment): unnormalized output, running max, running sum.
    partials = [out] * 3  # placeholders: the one-segment kernel never touches them
    if segments > 1:
        shape = (num_tokens, num_q_heads, segments)
        partials = [torch.empty((*shape, head_dim), dtype=torch.float32, device=q.device)]
        partials += [torch.empty(shape, dtype=torch.float32, device=q.device) for _ in range(2)]
    sink_logits = out if sinks is None else sinks.to(device=q.device, dtype=torch.float32).contiguous()
    _attention_kernel[(num_q_blocks, num_kv_heads, segments)](
        q, k_cache, v_cache, out, page_table,
        rows.req_pool_idx, rows.q_starts, rows.prefix_lens, *partials, sink_logits,
        rows.num_rows, num_q_heads, scale, logit_softcap,
        sliding_window if sliding_window > 0 else NO_WINDOW,
        tiles_per_segment,
        *q.stride()[:2], *out.stride()[:2],  # token and head strides
        *k_cache.stride()[:2], *v_cache.stride()[:2], page_table.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=tiles.block_d,
        GROUP=num_q_heads // num_kv_heads,
        BLOCK_Q=tiles.block_q,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        PAGE_SIZE=page_size,
        NUM_SEGMENTS=segments,
        USE_SOFTCAP=logit_softcap > 0,
        USE_SINKS=sinks is not None,
        # fp32 must match HF fp32, so no TF32 there; 16-bit values are exact in TF32 (10-bit mantissa).
        DOT_PRECISION="ieee" if fp32 else "tf32",
        num_warps=tiles.num_warps,
    )  # fmt: skip
    if segments > 1:
        _merge_segments_kernel[(num_tokens, num_q_heads)](
            out, *partials, sink_logits, num_q_heads, *out.stride()[:2],
            HEAD_DIM=head_dim,
            BLOCK_D=tiles.block_d,
            NUM_SEGMENTS=segments,
            BLOCK_S=triton.next_power_of_2(segments),
            USE_SINKS=sinks is not None,
        )  # fmt: skip


def _check_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    page_table: torch.Tensor,
    rows: AttentionRows,
) -> None:
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    assert out.shape == q.shape and q.shape[0] == rows.num_tokens, "q, out and rows disagree on T"
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == q.shape[2], "K/V pools do not fit q"
    assert num_q_heads % num_kv_heads == 0, f"{num_q_heads} query heads over {num_kv_heads} KV heads"
    assert page_table.dtype == torch.int64 and page_table.stride(1) == 1, "page_table: int64, rows contiguous"
    assert all(t.stride(-1) == 1 for t in (q, out, k_cache, v_cache)), "the head dim must be contiguous"
