"""The K/V write: a batch's new keys and values into their pool rows, one launch for both."""

from __future__ import annotations

from gpu_worker.backends.triton.interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported: see interpreter.py

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _write_kv_kernel(
    k_cache_ptr,
    v_cache_ptr,
    k_ptr,
    v_ptr,
    out_locs_ptr,
    num_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kct,
    stride_kch,
    stride_vct,
    stride_vch,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: its [heads, head_dim] K and V tiles go to pool row out_locs[token].
    token = tl.program_id(0)
    loc = tl.load(out_locs_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < HEAD_DIM)
    # Rounded to the pool's dtype on the store (a 16-bit pool under float32 activations).
    k = tl.load(k_ptr + token.to(tl.int64) * stride_kt + heads * stride_kh + dims, mask=mask)
    k = k.to(k_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + loc * stride_kct + heads * stride_kch + dims, k, mask=mask)
    v = tl.load(v_ptr + token.to(tl.int64) * stride_vt + heads * stride_vh + dims, mask=mask)
    v = v.to(v_cache_ptr.dtype.element_ty)
    tl.store(v_cache_ptr + loc * stride_vct + heads * stride_vch + dims, v, mask=mask)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_locs: torch.Tensor
) -> None:
    """Store ``k``/``v`` ``[T, Hkv, D]`` into pool rows ``out_locs`` (int64 ``[T]``), one launch for both.

    Any token and head strides are accepted (``k`` may be a view into a fused QKV output); the last
    dimension of every tensor must be contiguous. ``k``/``v`` are rounded to the pool's dtype (a 16-bit
    pool under float32 activations: ``--kv-cache-dtype``).
    """
    num_tokens, num_heads, head_dim = k.shape
    assert v.shape == k.shape and k_cache.shape[1:] == k.shape[1:] == v_cache.shape[1:], (
        f"k {tuple(k.shape)}, v {tuple(v.shape)} do not fit the pool rows {tuple(k_cache.shape[1:])}"
    )
    assert k.dtype == v.dtype and k_cache.dtype == v_cache.dtype, "k and v, and the two pools, share a dtype"
    assert out_locs.shape == (num_tokens,) and out_locs.dtype == torch.int64, "out_locs: int64 [T]"
    assert all(t.stride(-1) == 1 for t in (k, v, k_cache, v_cache)), "the head dim must be contiguous"
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k_cache,
        v_cache,
        k,
        v,
        out_locs,
        num_heads,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
