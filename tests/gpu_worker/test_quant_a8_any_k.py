"""The legacy types' 8-bit activations at a k that is not whole 256s (csrc/quant_x8.c's a8_any:
the whole 256s on quant_kx8.c's 8-bit tile, the rest past them on the 16-bit tile, added): against
float64 of the activations as each part quantized them, the whole-256 case the 8-bit tile's own
bits, a row's output whatever rows are beside it, and QuantLinear taking them for Q8_0 (Gemma 3's
640-wide head) but not Q4_0 (A8_ANY_K)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.layouts import A8, kernel_type
from gpu_worker.backends.cpu.quant import A8_ANY_K_MIN_ROWS, A8_MIN_ROWS, NEVER, QuantLinear, a8_min_rows
from gpu_worker.weights.formats import QuantizedWeight
from tests.gpu_worker import test_quant_kernels as legacy
from tests.gpu_worker.quant_reference import EPS32, quantize_act
from tests.gpu_worker.test_quant_a8 import a8_type, held, kernels, quantized, values
from tests.gpu_worker.test_quant_k_kernels import activations

__all__ = ["kernels"]  # the fixture: each kind with the 8-bit tiles

# (n, k): 2 whole 256s and 4 blocks of 32 (Gemma 3's hidden); none whole; one whole and one block;
# whole 256s only (the 8-bit tile alone)
SHAPES = [(24, 640), (16, 160), (16, 288), (16, 512)]


def quantized_any(kernels: cpu_kernels.CpuKernels, x: torch.Tensor) -> np.ndarray:
    """float64 [rows, k]: what the tiles multiply, the whole 256s as act_block8, the rest as act_block16."""
    whole = x.shape[1] // 256 * 256
    rest = quantize_act(x[:, whole:].float().numpy())[0] if whole < x.shape[1] else np.zeros((x.shape[0], 0))
    head = values(quantized(kernels, x[:, :whole])) if whole else np.zeros((x.shape[0], 0))
    return np.concatenate([head, rest], axis=1)


@pytest.mark.parametrize("qtype", legacy.LEGACY, ids=[t.name for t in legacy.LEGACY])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 13, 40])
def test_any_k_matches_float64(kernels: cpu_kernels.CpuKernels, qtype: Q, n: int, k: int, rows: int) -> None:
    x8, deq, bound = held(qtype, n, k)
    x = activations(rows, k, rows * 7 + k, torch.float32)
    x[0, k - 3] = 900.0  # an outlier in the rest, and one in a whole 256 (its residual pass)
    x[-1, 5] = -700.0
    residual = torch.randn(rows, n) if rows % 2 else None
    y = kernels.quant_matmul(a8_type(kernels, x8), x8.data, k, x, residual)
    xq = quantized_any(kernels, x)
    res64 = residual.double().numpy() if residual is not None else np.zeros((rows, n))
    want = res64 + xq @ deq.T
    tol = (6 * k / 32 + 24) * EPS32 * (np.abs(xq) @ bound.T) + EPS32 * (np.abs(want) + np.abs(res64)) + 1e-30
    got = y.double().numpy()
    assert (np.abs(got - want) <= tol).all(), f"worst {np.max(np.abs(got - want) / tol):.3g}"
    # and the 8 bits' rounding is what moved it from the unquantized product
    x64 = x.double().numpy()
    assert (np.abs(got - res64 - x64 @ deq.T) <= np.abs(x64 - xq) @ np.abs(deq).T + tol).all()


@pytest.mark.parametrize("qtype", legacy.LEGACY, ids=[t.name for t in legacy.LEGACY])
def test_rows_alone_or_together_give_the_same_bits(kernels: cpu_kernels.CpuKernels, qtype: Q) -> None:
    x8, _, _ = held(qtype, 40, 640)
    t = a8_type(kernels, x8)
    x = activations(33, 640, 2, torch.bfloat16)
    together = kernels.quant_matmul(t, x8.data, 640, x)
    for i in (0, 7, 32):
        assert torch.equal(kernels.quant_matmul(t, x8.data, 640, x[i : i + 1]), together[i : i + 1])
    order = torch.tensor([32, 3, 9, 0])
    assert torch.equal(kernels.quant_matmul(t, x8.data, 640, x[order]), together[order])


def test_q8_0_linear_takes_8_bits_at_640_and_q4_0_keeps_16(kernels: cpu_kernels.CpuKernels) -> None:
    q8, q4 = held(Q.Q8_0, 16, 640)[0], held(Q.Q4_0, 16, 640)[0]
    if not kernels.quant_supported(kernel_type(q8) | A8):
        assert a8_min_rows(kernels, q8) == NEVER
        pytest.skip("Q8_0 has no 8-bit tile on this kind")
    at = a8_min_rows(kernels, q8)
    assert at == max(A8_MIN_ROWS[kernels.kind][Q.Q8_0], A8_ANY_K_MIN_ROWS) < NEVER
    assert a8_min_rows(kernels, q4) == NEVER
    linear = QuantLinear(QuantizedWeight((q8,)), None, kernels)
    x = activations(at + 3, 640, 4, torch.float32)
    assert torch.equal(linear(x), kernels.quant_matmul(kernel_type(q8) | A8, q8.data, 640, x))
    assert not torch.equal(linear(x), kernels.quant_matmul(kernel_type(q8), q8.data, 640, x))
    verify = x[: A8_ANY_K_MIN_ROWS - 1]  # one request's speculative verify pass stays on 16 bits
    assert torch.equal(linear(verify), kernels.quant_matmul(kernel_type(q8), q8.data, 640, verify))
