"""The quantized-weight matmul and row lookup (csrc/quant.c, quant_legacy.c) against float64 references
built from gguf-py's own quantization and dequantization of the same blocks, on every CPU kind this
machine runs."""

from __future__ import annotations

import functools
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.cpu import kernels as cpu_kernels
from gpu_worker.cpu.kind import CpuKind, requested_kind

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

KINDS = [kind for kind in CpuKind if requested_kind().includes(kind)]
LEGACY = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
EPS32 = 2.0**-24  # float32's unit roundoff
# (n, k): n around the tiles (4 weight rows at one activation row, 2 at several, 8-column units),
# k from one block to 32 (a scale chunk and a tail).
SHAPES = [(1, 32), (7, 96), (33, 576), (100, 1024)]


@pytest.fixture(scope="module", params=KINDS, ids=[kind.value for kind in KINDS])
def kernels(request: pytest.FixtureRequest) -> cpu_kernels.CpuKernels:
    kind: CpuKind = request.param
    return cpu_kernels.CpuKernels(cpu_kernels.build(kind), kind)


@functools.cache
def weights(qtype: Q, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(blocks uint8 [n, row bytes] from gguf's quantize, their float64 dequantization [n, k], and a
    bound on the magnitudes of the terms the kernel sums, per weight [n, k])."""
    rng = np.random.default_rng(n * 10_000 + k + int(qtype))
    w = (
        rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1)) + rng.uniform(-0.5, 0.5, (n, 1))
    ).astype(np.float32)
    blocks = gguf.quants.quantize(w, qtype)
    deq = gguf.quants.dequantize(blocks, qtype).astype(np.float64)
    # The kernel sums d * dq * dot(q, qx) and, for Q4_1, the min term m * s separately: their
    # magnitudes, not |w|, bound its float32 rounding. Per weight: Q4_1 |d| q + |m| <= |w| + 2|m|,
    # Q8_0 |w|; Q4_0 |w| (its -8 is in the integer dot), kept at |w| + 16|d| so a kernel that sums
    # -8 d * s as a min term (|d| q + 8|d|) also fits.
    per_block = blocks.reshape(n, k // 32, -1)
    d = np.abs(per_block[..., :2].copy().view(np.float16).astype(np.float64))  # [n, nb, 1]
    extra = 0 * d
    if qtype == Q.Q4_0:
        extra = 16 * d
    elif qtype == Q.Q4_1:
        extra = 2 * np.abs(per_block[..., 2:4].copy().view(np.float16).astype(np.float64))
    bound = np.abs(deq) + np.repeat(extra, 32, axis=-1).reshape(n, k)
    return blocks, deq, bound


def quantize_act(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's activation quantization (quant.c's quantize_act16), in numpy: per block of 32,
    d = max|x| / 32767 and q = round-half-even(x * (32767 / max|x|)), every operation in float32 as
    the C code does it (the same roundings: the tight check compares exactly these values).
    -> (d * q as float64 [m, k], d [m, nb])."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // 32, 32)
    amax = np.abs(xb).max(axis=-1)
    d = amax / np.float32(32767)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(32767) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None])
    assert q.dtype == np.float32 and np.abs(q).max() <= 32767
    return (q.astype(np.float64) * d[..., None].astype(np.float64)).reshape(m, k), d.astype(np.float64)


# Half a quantization step, with float32's slack: q = rint(x * inv) where inv = 32767 / max|x| and
# d = max|x| / 32767 are each rounded once and x * inv once more, so x * inv is x / d within 3
# roundings of |x / d| <= 32767 (+ a hair): |x - d q| <= d (0.5 + 32767 * 3 eps32)
# < d (0.5 + 32768 * 4 eps32).
HALF_STEP = 0.5 + 32768 * 4 * EPS32  # ~0.5078


@pytest.mark.parametrize("qtype", LEGACY, ids=[t.name for t in LEGACY])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 32, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_quant_matmul_matches_float64(
    kernels: cpu_kernels.CpuKernels,
    qtype: Q,
    n: int,
    k: int,
    rows: int,
    dtype: torch.dtype,
    with_residual: bool,
) -> None:
    blocks, deq, bound = weights(qtype, n, k)
    gen = torch.Generator().manual_seed(rows * 7 + n)
    # x rows strided (a slice of wider rows), with an outlier per row so blocks differ in scale
    wide = torch.randn(rows, k + 5, generator=gen) * torch.rand(rows, 1, generator=gen) * 3
    wide[:, 3] *= 20
    x = wide.to(dtype)[:, 2 : k + 2]
    residual = torch.randn(rows, n, generator=gen).to(dtype) if with_residual else None
    y = kernels.quant_matmul(int(qtype), torch.from_numpy(blocks), k, x, residual)
    assert y.shape == (rows, n) and y.dtype == dtype

    x64 = x.double().numpy()  # exactly the values the kernel read
    res64 = residual.double().numpy() if residual is not None else np.zeros((rows, n))
    got = y.double().numpy()
    # the one rounding at the end (bf16: 2^-9 relative, doubled)
    out_round = 2.0**-8 if dtype == torch.bfloat16 else EPS32

    # (a) tight, against the activations as the kernel quantized them: only float32 rounding is left.
    # Each block's term is a float32 product (scale d_w * d_x rounded, the integer dot exact) summed with
    # the others and the min terms in float32: at most ~(2 nb + 8) roundings of eps32 on the sum of
    # the terms' magnitudes; then the final rounding relative to |y|.
    xq, dx = quantize_act(x.float().numpy())
    ref_q = res64 + xq @ deq.T
    terms = np.abs(xq) @ bound.T
    tol_a = (2 * (k // 32) + 8) * EPS32 * terms + out_round * np.abs(ref_q) + EPS32 * np.abs(res64) + 1e-30
    err_a = np.abs(got - ref_q)
    assert (err_a <= tol_a).all(), f"tight: worst err/tol {np.max(err_a / tol_a):.3g}"

    # (b) loose, against unquantized x: rounding x * 32767 / max|x| to an integer moves each element
    # by at most half a step, d_x / 2 (HALF_STEP: with float32's slack), so a block's dot moves by at
    # most that times sum |w| over the block; plus (a)'s float32 tolerance. With 16-bit activations
    # d_x = max|x| / 32767, 258x finer than int8's max|x| / 127.
    ref = res64 + x64 @ deq.T
    absw_blocks = np.abs(deq).reshape(n, k // 32, 32).sum(axis=-1)  # [n, nb]
    tol_b = HALF_STEP * dx @ absw_blocks.T + tol_a
    err_b = np.abs(got - ref)
    assert (err_b <= tol_b).all(), f"loose: worst err/tol {np.max(err_b / tol_b):.3g}"


def test_quant_matmul_many_rows_and_columns(kernels: cpu_kernels.CpuKernels) -> None:
    """Several panels and row chunks per thread, both thread splits: against float64 on a wider matrix."""
    for qtype in LEGACY:
        blocks, deq, bound = weights(qtype, 1000, 128)
        for rows in (1, 3, 70):
            x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
            y = kernels.quant_matmul(int(qtype), torch.from_numpy(blocks), 128, x).double().numpy()
            xq, _ = quantize_act(x.numpy())
            ref = xq @ deq.T
            tol = 16 * EPS32 * (np.abs(xq) @ bound.T) + EPS32 * np.abs(ref)
            assert (np.abs(y - ref) <= tol).all(), (qtype.name, rows)


@pytest.mark.parametrize("qtype", LEGACY, ids=[t.name for t in LEGACY])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_quant_get_rows_bit_exact(kernels: cpu_kernels.CpuKernels, qtype: Q, dtype: torch.dtype) -> None:
    """Dequantized rows equal gguf's float32 dequantization bit for bit (bf16: that, rounded once)."""
    blocks, _, _ = weights(qtype, 33, 576)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    ids = torch.tensor([5, 0, 32, 5, 17], dtype=torch.int64)
    got = kernels.quant_get_rows(int(qtype), torch.from_numpy(blocks), 576, ids, dtype)
    assert got.dtype == dtype and got.shape == (5, 576)
    assert torch.equal(got, expected[ids].to(dtype))
    assert kernels.quant_get_rows(int(qtype), torch.from_numpy(blocks), 576, ids[:0], dtype).shape == (0, 576)


def test_quant_refuses_unsupported(kernels: cpu_kernels.CpuKernels) -> None:
    """Types without a kernel (here Q5_0, F16) and k not a whole number of blocks are refused,
    by the C entry points (status, 0 row bytes) and the bindings (ValueError)."""
    for qtype in LEGACY:
        assert kernels.quant_supported(int(qtype))
        assert kernels._quant_act_row_bytes(int(qtype), 64) == 2 * 72
        assert kernels._quant_act_row_bytes(int(qtype), 48) == 0
    for qtype in (Q.Q5_0, Q.F16, Q.F32):
        assert not kernels.quant_supported(int(qtype))
        assert kernels._quant_act_row_bytes(int(qtype), 64) == 0
    blocks, _, _ = weights(Q.Q8_0, 7, 96)
    w = torch.from_numpy(blocks)
    x = torch.randn(2, 96)
    y = torch.full((2, 7), 7.0)
    scratch = torch.empty(2 * 3 * 72, dtype=torch.uint8)

    def raw(qtype: int, k: int) -> int:
        return int(
            kernels._quant_matmul(
                qtype,
                w.data_ptr(),
                7,
                k,
                x.data_ptr(),
                96,
                0,
                2,
                scratch.data_ptr(),
                y.data_ptr(),
                0,
                None,
                0,
            )
        )

    assert raw(int(Q.Q5_0), 96) == 1
    assert raw(int(Q.Q8_0), 48) == 2
    assert (y == 7.0).all(), "a refused call writes nothing"
    assert raw(int(Q.Q8_0), 96) == 0
    with pytest.raises(ValueError):
        kernels.quant_matmul(int(Q.Q5_0), w, 96, x)
    with pytest.raises(ValueError):
        kernels.quant_matmul(int(Q.Q8_0), w, 48, x[:, :48])
    with pytest.raises(ValueError):
        kernels.quant_get_rows(int(Q.Q5_0), w, 96, torch.tensor([0]), torch.float32)
