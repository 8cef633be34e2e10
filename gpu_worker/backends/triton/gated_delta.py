"""The gated delta rule of Gated DeltaNet layers in Triton: a decode step of every row, and the chunked
prefill of every row, over a pool of float32 recurrent states (the CPU kernels' contract:
backends/cpu/gated_delta.py's module docstring has the shapes).

    decode(q, k, v, g, beta, state, slots, *, fresh=None, l2norm=True, scale=None) -> [B, Hv, Dv]
    prefill(q, k, v, g, beta, state, slots, cu_seqlens, *, fresh=None, l2norm=True, scale=None)
        -> [N, Hv, Dv]

Each column of a value head's state S [Dk, Dv] evolves on its own (the rule mixes rows of S, never
columns), so a program owns one (row, value head, block of Dv columns): its slice of S stays in
registers through the row's tokens and is stored once. Prefill folds each block of CHUNK tokens into
a unit lower-triangular system (I + A) U = rhs, solved by forward substitution on U, and three
products (all float32, "ieee": TF32's 10-bit mantissa would not be the recurrence to float32
rounding). A block's tail past the row's end loads as zeros (k, v, beta = 0 and g = 0), which adds
nothing to U or to S, so no length is special.

Ours rather than fla-core's: these are two small kernels the interpreter runs for the tests, where
fla's chunked pipeline is many autotuned kernels and a dependency.
"""

from __future__ import annotations

from gpu_worker.backends.triton.interpreter import use_interpreter_without_cuda

use_interpreter_without_cuda()  # before triton is imported: see interpreter.py

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# Prefill's block of tokens and warps: at 16 a block's systems and tiles stay in registers through
# the substitution's loop, which is also 4x shorter than at 64; 32 and 64 were several times slower
# at Qwen3.5-4B's heads on an H200 (the chunk changes only the sums' rounding).
CHUNK = 16
NUM_WARPS = 4
BLOCK_V = 32  # state columns a program owns
tiled_heads = False  # value head h reads key head h // (Hv / Hk) alone (the PooledRule protocol)


@triton.jit
def _load_qk(ptr, row, stride, head, dk, offs_k, L2NORM: tl.constexpr, scale):
    """One token's key-head vector [BLOCK_K] as float32, L2-normed when asked (eps 1e-6, HF's
    l2norm), times scale."""
    x = tl.load(ptr + row.to(tl.int64) * stride + head * dk + offs_k, mask=offs_k < dk, other=0.0).to(
        tl.float32
    )
    if L2NORM:
        x = x / tl.sqrt(tl.sum(x * x, 0) + 1e-6)
    return x * scale


@triton.jit
def _load_rows(ptr, tok64, t_ok, stride, head, dk, offs_k, L2NORM: tl.constexpr, scale):
    """The key-head vectors [BT, BLOCK_K] of a block's tokens as _load_qk has one (zeros past the row)."""
    mask = t_ok[:, None] & (offs_k < dk)[None, :]
    x = tl.load(ptr + tok64[:, None] * stride + head * dk + offs_k[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    if L2NORM:
        x = x / tl.sqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
    return x * scale


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, fresh_ptr, out_ptr,
    stride_q, stride_k, stride_v, stride_g, stride_beta, v_heads, group, dk, dv, scale,
    L2NORM: tl.constexpr, HAS_FRESH: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = offs_k < dk, offs_v < dv
    slot = tl.load(slots_ptr + row)
    s_ptrs = state_ptr + (slot * v_heads + h) * dk * dv + offs_k[:, None] * dv + offs_v[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0)
    if HAS_FRESH:
        s = tl.where(tl.load(fresh_ptr + row) != 0, 0.0, s)
    hk = h // group
    q = _load_qk(q_ptr, row, stride_q, hk, dk, offs_k, L2NORM, scale)
    k = _load_qk(k_ptr, row, stride_k, hk, dk, offs_k, L2NORM, 1.0)
    v = tl.load(v_ptr + row.to(tl.int64) * stride_v + h * dv + offs_v, mask=v_ok, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(g_ptr + row.to(tl.int64) * stride_g + h).to(tl.float32))
    beta = tl.load(beta_ptr + row.to(tl.int64) * stride_beta + h).to(tl.float32)
    delta = beta * (v - a * tl.sum(s * k[:, None], 0))
    s = a * s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], 0)
    tl.store(s_ptrs, s, mask=s_mask)
    tl.store(
        out_ptr + (row.to(tl.int64) * v_heads + h) * dv + offs_v, o.to(out_ptr.dtype.element_ty), mask=v_ok
    )


@triton.jit
def _forward_substitution(a, u, BT: tl.constexpr):
    """U solving (I + A) U = u for A [BT, BT] strictly lower triangular: row i of U is final once
    the rows before it are, so one pass down the rows."""
    rows = tl.arange(0, BT)
    for i in range(1, BT):
        a_i = tl.sum(tl.where(rows[:, None] == i, a, 0.0), 0)  # row i of A
        u = tl.where(rows[:, None] == i, u - tl.sum(a_i[:, None] * u, 0)[None, :], u)
    return u


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, fresh_ptr, cu_ptr, out_ptr,
    stride_q, stride_k, stride_v, stride_g, stride_beta, v_heads, group, dk, dv, scale,
    L2NORM: tl.constexpr, HAS_FRESH: tl.constexpr, BT: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    seq, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = tl.load(cu_ptr + seq), tl.load(cu_ptr + seq + 1)
    offs_k, offs_t = tl.arange(0, BLOCK_K), tl.arange(0, BT)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = offs_k < dk, offs_v < dv
    slot = tl.load(slots_ptr + seq)
    s_ptrs = state_ptr + (slot * v_heads + h) * dk * dv + offs_k[:, None] * dv + offs_v[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0)
    if HAS_FRESH:
        s = tl.where(tl.load(fresh_ptr + seq) != 0, 0.0, s)
    hk = h // group
    lower = offs_t[:, None] > offs_t[None, :]
    for t0 in range(start, end, BT):
        tok = t0 + offs_t
        t_ok = tok < end
        tok64 = tok.to(tl.int64)
        k = _load_rows(k_ptr, tok64, t_ok, stride_k, hk, dk, offs_k, L2NORM, 1.0)
        q = _load_rows(q_ptr, tok64, t_ok, stride_q, hk, dk, offs_k, L2NORM, scale)
        v_mask = t_ok[:, None] & v_ok[None, :]
        v = tl.load(v_ptr + tok64[:, None] * stride_v + h * dv + offs_v[None, :], mask=v_mask, other=0.0)
        g = tl.load(g_ptr + tok64 * stride_g + h, mask=t_ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + tok64 * stride_beta + h, mask=t_ok, other=0.0).to(tl.float32)
        gc = tl.cumsum(g, 0)
        gc_last = tl.sum(tl.where(offs_t == BT - 1, gc, 0.0), 0)
        # exponents gc_i - gc_j <= 0 where kept (g <= 0); the others are zeroed before exp, then dropped
        causal = offs_t[:, None] >= offs_t[None, :]
        decay = tl.where(causal, tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
        # q and k are done with before the substitution (k is read again after it), so fewer values
        # stay live through its loop
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
        o = tl.exp(gc)[:, None] * tl.dot(q, s, input_precision="ieee")
        a = tl.where(lower, beta[:, None] * decay * tl.dot(k, tl.trans(k), input_precision="ieee"), 0.0)
        rhs = beta[:, None] * (v.to(tl.float32) - tl.exp(gc)[:, None] * tl.dot(k, s, input_precision="ieee"))
        u = _forward_substitution(a, rhs, BT)
        o += tl.dot(qk, u, input_precision="ieee")
        o_ptrs = out_ptr + (tok64[:, None] * v_heads + h) * dv + offs_v[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=v_mask)
        k = (
            _load_rows(k_ptr, tok64, t_ok, stride_k, hk, dk, offs_k, L2NORM, 1.0)
            * tl.exp(gc_last - gc)[:, None]
        )
        s = tl.exp(gc_last) * s + tl.dot(tl.trans(k), u, input_precision="ieee")
    tl.store(s_ptrs, s, mask=s_mask)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    tiled: bool,
) -> None:
    assert not tiled, "these kernels read key head h // (Hv / Hk) alone (tiled_heads is False)"
    tokens, k_heads, dk = k.shape
    _, v_heads, dv = v.shape
    assert q.shape == k.shape and v.shape[0] == tokens and v_heads % k_heads == 0, (
        f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: not [N, Hk, Dk], [N, Hv, Dv]"
    )
    for t, dim in ((q, dk), (k, dk), (v, dv)):
        assert t.stride(2) == 1 and t.stride(1) == dim, "each row's heads must be contiguous"
    for t in (g, beta):
        assert t.shape == (tokens, v_heads) and t.stride(1) == 1, "g, beta: [N, Hv], heads contiguous"
    assert state.dtype == torch.float32 and state.is_contiguous(), "state: contiguous float32"
    assert state.shape[1:] == (v_heads, dk, dv), (
        f"state {tuple(state.shape)} is not [S, {v_heads}, {dk}, {dv}]"
    )


def _common(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[int, ...]:
    """The strides and sizes both kernels take after their pointers."""
    group = v.shape[1] // k.shape[1]
    return (q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0), v.shape[1], group, k.shape[2],
            v.shape[2])  # fmt: skip


def decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    *,
    fresh: torch.Tensor | None = None,
    l2norm: bool = True,
    scale: float | None = None,
    tiled: bool = False,
) -> torch.Tensor:
    """One token per row through the rule; ``state[slots]`` advanced in place (module docstring)."""
    _check(q, k, v, g, beta, state, tiled)
    rows, v_heads, dv = v.shape
    out = torch.empty((rows, v_heads, dv), dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    grid = (rows, v_heads, triton.cdiv(dv, BLOCK_V))
    _decode_kernel[grid](
        q, k, v, g, beta, state, slots, slots if fresh is None else fresh, out, *_common(q, k, v, g, beta),
        k.shape[2] ** -0.5 if scale is None else scale, L2NORM=l2norm, HAS_FRESH=fresh is not None,
        BLOCK_K=triton.next_power_of_2(k.shape[2]), BLOCK_V=BLOCK_V,
    )  # fmt: skip
    return out


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    fresh: torch.Tensor | None = None,
    l2norm: bool = True,
    scale: float | None = None,
    chunk: int = CHUNK,
    num_warps: int = NUM_WARPS,
    tiled: bool = False,
) -> torch.Tensor:
    """Each row's tokens [cu_seqlens[i], cu_seqlens[i + 1]) through the chunked rule; ``state[slots]``
    advanced in place (module docstring). ``chunk`` (a power of 2, >= 16) and ``num_warps`` tune
    the launch; the chunk changes only the sums' rounding."""
    _check(q, k, v, g, beta, state, tiled)
    tokens, v_heads, dv = v.shape
    seqs = len(cu_seqlens) - 1
    out = torch.empty((tokens, v_heads, dv), dtype=q.dtype, device=q.device)
    if seqs == 0:
        return out
    grid = (seqs, v_heads, triton.cdiv(dv, BLOCK_V))
    _prefill_kernel[grid](
        q, k, v, g, beta, state, slots, slots if fresh is None else fresh, cu_seqlens, out,
        *_common(q, k, v, g, beta), k.shape[2] ** -0.5 if scale is None else scale, L2NORM=l2norm,
        HAS_FRESH=fresh is not None, BT=chunk, BLOCK_K=max(16, triton.next_power_of_2(k.shape[2])),
        BLOCK_V=BLOCK_V, num_warps=num_warps,
    )  # fmt: skip
    return out
