"""Q2_K and Q3_K blocks (csrc/quant_k23.c): the integer path (one row and many), the dense path and the
row lookup against float64 products over gguf-py's dequantization of the same blocks, on every CPU
kind this machine runs. gguf-py cannot quantize them: the blocks are random bytes with fp16 scales of
a sane size (every group scale, min and high bit then occurs)."""

from __future__ import annotations

import functools
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.backends.cpu import kernels as cpu_kernels
from tests.gpu_worker.quant_reference import EPS32, HALF_STEP, activations, check_quant_matmul

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

K23 = [Q.Q2_K, Q.Q3_K]
SHAPES = [(1, 256), (7, 512), (33, 1280)]
CASES = [(t, n, k) for t in K23 for n, k in SHAPES]


@functools.cache
def weights(qtype: Q, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(blocks, gguf-py's float64 dequantization [n, k], a bound per weight on the terms the kernel
    sums: Q2_K |d sc q| + |dmin m| (two dots), Q3_K |w|)."""
    rng = np.random.default_rng(n * 10_000 + k + int(qtype))
    size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n, k // size, block_bytes), dtype=np.uint8)
    at = [80, 82] if qtype == Q.Q2_K else [108]  # d, dmin; d
    for off in at:
        blocks[..., off : off + 2] = (
            rng.uniform(0.001, 0.02, (n, k // size)).astype(np.float16).view(np.uint8).reshape(n, -1, 2)
        )
    blocks = blocks.reshape(n, -1)
    deq = gguf.quants.dequantize(blocks, qtype).astype(np.float64)
    bound = np.abs(deq)
    if qtype == Q.Q2_K:
        per = blocks.reshape(n, k // 256, 84)
        dmin = per[..., 82:84].copy().view(np.float16).astype(np.float64)  # [n, nb, 1]
        mins = (per[..., :16] >> 4).astype(np.float64)  # [n, nb, 16]
        bound = bound + 2 * np.repeat((dmin * mins).reshape(n, -1), 16, axis=-1)
    return blocks, deq, bound


@pytest.mark.parametrize(("qtype", "n", "k"), CASES, ids=[f"{q.name}-{n}x{k}" for q, n, k in CASES])
@pytest.mark.parametrize("rows", [1, 7, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_integer_path_matches_float64(
    kernels: cpu_kernels.CpuKernels, qtype: Q, n: int, k: int, rows: int, dtype: torch.dtype
) -> None:
    blocks, deq, bound = weights(qtype, n, k)
    x = activations(rows, k, dtype, rows * 7 + n)
    residual = (
        torch.randn(rows, n, generator=torch.Generator().manual_seed(n)).to(dtype) if rows == 7 else None
    )
    assert kernels.quant_supported(int(qtype))
    y = kernels.quant_matmul(int(qtype), torch.from_numpy(blocks), k, x, residual)
    assert y.shape == (rows, n) and y.dtype == dtype
    check_quant_matmul(y, x, residual, deq, bound, 2 * k // 32, HALF_STEP)


@pytest.mark.parametrize(("qtype", "n", "k"), CASES, ids=[f"{q.name}-{n}x{k}" for q, n, k in CASES])
def test_dense_path_matches_float64(kernels: cpu_kernels.CpuKernels, qtype: Q, n: int, k: int) -> None:
    blocks, deq, _ = weights(qtype, n, k)
    x = activations(9, k, torch.float32, n)
    y = kernels.quant_matmul(int(qtype), torch.from_numpy(blocks), k, x, None, dense=True).double().numpy()
    x64 = x.double().numpy()
    ref = x64 @ deq.T
    tol = (k / 8 + 8) * EPS32 * (np.abs(x64) @ np.abs(deq).T) + 1e-30
    assert (np.abs(y - ref) <= tol).all(), f"worst err/tol {np.max(np.abs(y - ref) / tol):.3g}"


@pytest.mark.parametrize("qtype", K23, ids=[t.name for t in K23])
def test_get_rows_bit_exact(kernels: cpu_kernels.CpuKernels, qtype: Q) -> None:
    blocks, _, _ = weights(qtype, 33, 1280)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    ids = torch.tensor([5, 0, 32, 5, 17], dtype=torch.int64)
    got = kernels.quant_get_rows(int(qtype), torch.from_numpy(blocks), 1280, ids, torch.float32)
    assert torch.equal(got, expected[ids])
