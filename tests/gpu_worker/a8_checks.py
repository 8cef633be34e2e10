"""Checks the interleaved-by-8 kernel tests share (test_quant_k23x8.py, test_quant_sub32x8.py,
test_mxfp4_a8.py): the layout against gguf-py's dequantization, the 16-bit tile's dense path and the
8-bit tile against float64, a row's output whatever rows are beside it."""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.kind import CpuKind
from gpu_worker.backends.cpu.layouts import A8, X8_LAYOUT, dequantize, interleave_rows, kernel_type
from gpu_worker.weights.formats import QuantBlocks
from tests.gpu_worker.helpers import KINDS
from tests.gpu_worker.quant_reference import EPS32, activations

SPREAD = 6.0  # csrc/quant.h's ACT8_SPREAD


def interleaved(qtype: int, blocks: np.ndarray, k: int) -> QuantBlocks:
    """A matrix's blocks with rows interleaved by 8."""
    x8 = interleave_rows(QuantBlocks(int(qtype), torch.from_numpy(blocks), k))
    assert x8.layout == X8_LAYOUT
    return x8


def a8_kinds() -> list[CpuKind]:
    return [kind for kind in KINDS if kind != CpuKind.PORTABLE]


def check_layout(kernels: cpu_kernels.CpuKernels, x8: QuantBlocks, deq: np.ndarray, qtype: int) -> None:
    """The interleaved layout's type, its dequantization and get_rows equal gguf-py's values."""
    n, k = deq.shape
    assert kernel_type(x8) == int(qtype) | 0x100
    assert np.array_equal(dequantize(x8).numpy(), deq.astype(np.float32))
    got = kernels.quant_get_rows(kernel_type(x8), x8.data, k, torch.arange(n - 1, -1, -1), torch.float32)
    assert torch.equal(got, torch.from_numpy(deq.astype(np.float32))[torch.arange(n - 1, -1, -1)])


def check_dense(kernels: cpu_kernels.CpuKernels, x8: QuantBlocks, x: torch.Tensor, deq: np.ndarray) -> None:
    """The dense path (float32 weights unpacked) against float64: k / 8 + 8 roundings of the terms."""
    k = deq.shape[1]
    dense = kernels.quant_matmul(kernel_type(x8), x8.data, k, x.float(), None, dense=True).double().numpy()
    ref = x.double().numpy() @ deq.T
    tol = (k / 8 + 8) * EPS32 * (np.abs(x.double().numpy()) @ np.abs(deq).T) + 1e-30
    assert (np.abs(dense - ref) <= tol).all()


def a8_step(x: torch.Tensor) -> np.ndarray:
    """Per activation value, an upper bound on |x - its 8-bit value| (act8_32: half of absmax / 127,
    or a 128th of that where the 32 clearly take the residual pass; near the criterion's edge, the
    larger)."""
    xb = x.double().numpy().reshape(x.shape[0], -1, 32)
    amax, asum = np.abs(xb).max(axis=-1), np.abs(xb).sum(axis=-1)
    half = amax / 127 * (0.5 + 1e-3)
    two = amax * 32 > SPREAD * asum * (1 + 1e-4)
    return np.repeat(np.where(two, half / 128 + 128 * EPS32 * amax / 127, half), 32, axis=-1).reshape(x.shape)


def check_a8_unquantized(
    y: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, deq: np.ndarray, bound: np.ndarray
) -> None:
    """act8_32's tile against the unquantized activations: what the 8-bit rounding moved (a8_step per
    value times |w|), plus float32 roundings of the terms (``bound`` per weight), plus the output's."""
    rows, k = x.shape
    n = deq.shape[0]
    got = y.double().numpy()
    x64 = x.double().numpy()
    res64 = residual.double().numpy() if residual is not None else np.zeros((rows, n))
    ref = res64 + x64 @ deq.T
    tol = a8_step(x) @ np.abs(deq).T + (6 * k / 32 + 16) * EPS32 * (1.01 * np.abs(x64) @ bound.T)
    tol += EPS32 * (np.abs(ref) + np.abs(res64)) + 1e-30
    assert (np.abs(got - ref) <= tol).all(), f"worst err/tol {np.max(np.abs(got - ref) / tol):.3g}"


def check_rows_alone(kernels: cpu_kernels.CpuKernels, x8: QuantBlocks, k: int) -> None:
    """Rows whose blocks take the residual pass (row 5) or are tiny (row 9) beside others: each row's
    8-bit output is the bits it has alone, in any order."""
    x = activations(21, k, torch.float32, 3)
    x[5, 300] = 5000.0
    x[9] *= 1e-3
    t = kernel_type(x8) | A8
    together = kernels.quant_matmul(t, x8.data, k, x)
    for i in (0, 5, 9, 20):
        assert torch.equal(kernels.quant_matmul(t, x8.data, k, x[i : i + 1]), together[i : i + 1])
    order = torch.tensor([9, 5, 0, 11, 3, 20, 1])
    assert torch.equal(kernels.quant_matmul(t, x8.data, k, x[order]), together[order])
