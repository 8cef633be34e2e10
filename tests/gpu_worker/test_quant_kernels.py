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

from gpu_worker.backends.cpu import kernels as cpu_kernels
from tests.gpu_worker.quant_reference import EPS32, HALF_STEP, activations, check_quant_matmul, quantize_act

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

LEGACY = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
# (n, k): n around the tiles (4 weight rows at one activation row, 2 at several, 8-column units),
# k from one block to 32 (a scale chunk and a tail).
SHAPES = [(1, 32), (7, 96), (33, 576), (100, 1024)]


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
    x = activations(rows, k, dtype, rows * 7 + n)
    residual = (
        torch.randn(rows, n, generator=torch.Generator().manual_seed(n)).to(dtype) if with_residual else None
    )
    y = kernels.quant_matmul(int(qtype), torch.from_numpy(blocks), k, x, residual)
    assert y.shape == (rows, n) and y.dtype == dtype

    check_quant_matmul(y, x, residual, deq, bound, k // 32, HALF_STEP)


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
    """Types without a kernel (here IQ2_XXS, Q8_1, F32) and k not a whole number of blocks are refused,
    by the C entry points (status, 0 row bytes) and the bindings (ValueError)."""
    for qtype in LEGACY:
        assert kernels.quant_supported(int(qtype))
        assert kernels._quant_act_row_bytes(int(qtype), 64) == 2 * 72
        assert kernels._quant_act_row_bytes(int(qtype), 48) == 0
    for qtype in (Q.IQ2_XXS, Q.Q8_1, Q.F32):
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
                7,
                0,
                None,
                0,
            )
        )

    assert raw(int(Q.IQ2_XXS), 96) == 1
    assert raw(int(Q.Q8_0), 48) == 2
    assert (y == 7.0).all(), "a refused call writes nothing"
    assert raw(int(Q.Q8_0), 96) == 0
    with pytest.raises(ValueError):
        kernels.quant_matmul(int(Q.IQ2_XXS), w, 96, x)
    with pytest.raises(ValueError):
        kernels.quant_matmul(int(Q.Q8_0), w, 48, x[:, :48])
    with pytest.raises(ValueError):
        kernels.quant_get_rows(int(Q.IQ2_XXS), w, 96, torch.tensor([0]), torch.float32)
