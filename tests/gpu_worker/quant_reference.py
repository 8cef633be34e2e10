"""The quantized kernels' float64 reference (quant.c's activation rounding replicated in numpy) and
the check both kernel test files apply: (a) tight, against the activations as the kernel quantized
them (float32 rounding only), (b) loose, against the unquantized activations."""

from __future__ import annotations

import numpy as np
import torch

EPS32 = 2.0**-24  # float32's unit roundoff
ACT_BLOCK = 32  # activation values per act_block16 (quant.h)
# Half a quantization step, with float32's slack: q = rint(x * inv) where inv = 32767 / max|x| and
# d = max|x| / 32767 are each rounded once and x * inv once more, so x * inv is x / d within 3
# roundings of |x / d| <= 32767 (+ a hair): |x - d q| <= d (0.5 + 32767 * 3 eps32)
# < d (0.5 + 32768 * 4 eps32).
HALF_STEP = 0.5 + 32768 * 4 * EPS32  # ~0.5078


def activations(rows: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """x [rows, k] for a kernel test: rows strided (a slice of wider rows), each with an outlier so
    blocks differ in scale."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, k + 5, generator=gen) * torch.rand(rows, 1, generator=gen) * 3
    wide[:, 3] *= 20
    return wide.to(dtype)[:, 2 : k + 2]


def quantize_act(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's activation quantization (quant.c's quantize_act16), in numpy, with the same float32
    operations: per block of 32, amax = max|x|, d = amax / 32767, inv = 32767 / amax (0 if amax is 0),
    q = round-half-even(x * inv). -> (d * q as float64 [m, k], d as float64 [m, k / 32]). (The block
    sums s = d * sum(q) the kernel also reads are one float32 rounding of sum(d * q): the tight
    tolerance covers them as one more rounding of the min terms.)"""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // ACT_BLOCK, ACT_BLOCK)
    amax = np.abs(xb).max(axis=-1)
    d = amax / np.float32(32767)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(32767) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None])
    assert q.dtype == np.float32 and np.abs(q).max() <= 32767
    return (q.astype(np.float64) * d[..., None].astype(np.float64)).reshape(m, k), d.astype(np.float64)


def check_quant_matmul(
    y: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    deq: np.ndarray,
    bound: np.ndarray,
    summed_blocks: int,
    half_step: float,
) -> None:
    """y = residual + x @ deq.T within (a) the tight and (b) the loose tolerance.

    (a) Each block's term is a float32 product (the integer dot exact, its scale rounded) summed
    with the others and the min terms in float32: at most ~(2 * summed_blocks + 8) roundings of
    eps32 on the sum of the terms' magnitudes (``bound`` per weight), then the final rounding
    relative to |y| (bf16: 2^-9, doubled). (b) Rounding x to a step of d_x moves each element by at
    most ``half_step`` * d_x, so a 32-block's dot moves by at most that times sum |w| over its
    weights; plus (a)'s tolerance."""
    rows, k = x.shape
    n = deq.shape[0]
    x64 = x.double().numpy()  # exactly the values the kernel read
    res64 = residual.double().numpy() if residual is not None else np.zeros((rows, n))
    got = y.double().numpy()
    out_round = 2.0**-8 if y.dtype == torch.bfloat16 else EPS32

    xq, dx = quantize_act(x.float().numpy())
    ref_q = res64 + xq @ deq.T
    terms = np.abs(xq) @ bound.T
    tol_a = (
        (2 * summed_blocks + 8) * EPS32 * terms + out_round * np.abs(ref_q) + EPS32 * np.abs(res64) + 1e-30
    )
    err_a = np.abs(got - ref_q)
    assert (err_a <= tol_a).all(), f"tight: worst err/tol {np.max(err_a / tol_a):.3g}"

    ref = res64 + x64 @ deq.T
    absw_blocks = np.abs(deq).reshape(n, k // ACT_BLOCK, ACT_BLOCK).sum(axis=-1)  # [n, k / 32]
    tol_b = half_step * dx @ absw_blocks.T + tol_a
    err_b = np.abs(got - ref)
    assert (err_b <= tol_b).all(), f"loose: worst err/tol {np.max(err_b / tol_b):.3g}"
