"""The quantized matmul's dense path (csrc/quant_dense.c: W dequantized to float32 panel by panel,
activations not quantized) for every supported type, against float64 on gguf-py's dequantization of
the same blocks, on every CPU kind this machine runs."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.backends.cpu import kernels as cpu_kernels
from tests.gpu_worker import test_quant_k_kernels as k_quants
from tests.gpu_worker import test_quant_kernels as legacy
from tests.gpu_worker.quant_reference import EPS32

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

# (type, n, k): n around the 3-row register tile and the 12-row thread units, k of one block and of
# several; rows around the 4-row register tile (7 = 4 + 3).
CASES = [(qtype, n, k) for qtype in legacy.LEGACY for n, k in ((1, 32), (37, 576))] + [
    (qtype, n, k) for qtype in k_quants.K_TYPES for n, k in ((1, 256), (37, 1536))
]


def blocks_and_dequantized(qtype: Q, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    module = legacy if qtype in legacy.LEGACY else k_quants
    blocks, deq, _ = module.weights(qtype, n, k)
    return blocks, deq


@pytest.mark.parametrize(("qtype", "n", "k"), CASES, ids=[f"{q.name}-{n}x{k}" for q, n, k in CASES])
@pytest.mark.parametrize("rows", [1, 7, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_dense_path_matches_float64(
    kernels: cpu_kernels.CpuKernels,
    qtype: Q,
    n: int,
    k: int,
    rows: int,
    dtype: torch.dtype,
    with_residual: bool,
) -> None:
    """Float32 sums of exact products (x widened exactly, W dequantized as gguf-py does): each output
    within (k / 8 + 8) float32 roundings of the sum of |x w| (8 lanes of k / 8 terms, then their
    sum), plus the final rounding to the output dtype."""
    blocks, deq = blocks_and_dequantized(qtype, n, k)
    gen = torch.Generator().manual_seed(rows * 7 + n)
    wide = torch.randn(rows, k + 3, generator=gen) * torch.rand(rows, 1, generator=gen) * 3
    x = wide.to(dtype)[:, 1 : k + 1]  # rows strided
    residual = torch.randn(rows, n, generator=gen).to(dtype) if with_residual else None
    y = kernels.quant_matmul(int(qtype), torch.from_numpy(blocks), k, x, residual, dense=True)
    assert y.shape == (rows, n) and y.dtype == dtype

    x64 = x.double().numpy()
    res64 = residual.double().numpy() if residual is not None else np.zeros((rows, n))
    ref = res64 + x64 @ deq.T
    out_round = 2.0**-8 if dtype == torch.bfloat16 else EPS32
    terms = np.abs(x64) @ np.abs(deq).T
    tol = (k / 8 + 8) * EPS32 * terms + out_round * np.abs(ref) + EPS32 * np.abs(res64)
    err = np.abs(y.double().numpy() - ref)
    assert (err <= tol + 1e-30).all(), f"worst err/tol {np.max(err / (tol + 1e-30)):.3g}"


def test_dense_and_integer_paths_agree_on_many_panels(kernels: cpu_kernels.CpuKernels) -> None:
    """Several panels per thread (1000 rows of k = 1024: 24 rows a panel) and a 70-row batch: the two
    paths differ only by the integer path's 16-bit activations, far below the outputs' size."""
    blocks, deq, _ = legacy.weights(Q.Q4_1, 100, 1024)
    blocks = np.tile(blocks, (10, 1))
    x = torch.randn(70, 1024, generator=torch.Generator().manual_seed(1))
    w = torch.from_numpy(blocks)
    dense = kernels.quant_matmul(int(Q.Q4_1), w, 1024, x, dense=True).double()
    integer = kernels.quant_matmul(int(Q.Q4_1), w, 1024, x).double()
    ref = x.double() @ torch.from_numpy(np.tile(deq, (10, 1))).T
    assert float((dense - ref).abs().max()) <= 1e-4 * float(ref.abs().max())
    assert float((integer - dense).abs().max()) <= 1e-3 * float(ref.abs().max())
