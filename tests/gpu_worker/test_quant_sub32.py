"""Q5_0, Q5_1, IQ4_NL and IQ4_XS blocks (csrc/quant_sub32.c): the integer path (one row and many),
the dense path and the row lookup against float64 products over gguf-py's dequantization of the same
blocks, on every CPU kind this machine runs. gguf-py quantizes Q5_0 and Q5_1; the IQ4 types' blocks
are built directly, random with sane scales."""

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

SUB32 = [Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS]
# (n, k): n around the tiles (4 weight rows at one activation row, 2 at several), k from one block
# to past a 32-sub-block scale chunk; IQ4_XS's k a multiple of 256.
SHAPES = {t: [(1, 32), (7, 96), (33, 640), (100, 1088)] for t in (Q.Q5_0, Q.Q5_1, Q.IQ4_NL)} | {
    Q.IQ4_XS: [(1, 256), (7, 512), (33, 1280)]
}
CASES = [(t, n, k) for t in SUB32 for n, k in SHAPES[t]]


def random_blocks(qtype: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row bytes] blocks of ``qtype``: gguf-py's quantization of random weights where it has
    one, else random bytes with fp16 scales of a sane size (a random sign: IQ4 files hold either)."""
    if qtype in (Q.Q5_0, Q.Q5_1):
        w = rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1)) + rng.uniform(-0.5, 0.5, (n, 1))
        return gguf.quants.quantize(w.astype(np.float32), qtype)
    size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n, k // size, block_bytes), dtype=np.uint8)
    d = (rng.uniform(0.002, 0.03, (n, k // size)) * rng.choice([-1, 1], (n, k // size))).astype(np.float16)
    blocks[..., :2] = d.view(np.uint8).reshape(n, k // size, 2)
    return blocks.reshape(n, -1)


@functools.cache
def weights(qtype: Q, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(blocks, their float64 dequantization [n, k] by gguf-py, a bound per weight on the magnitude
    of the terms the kernel sums: |w|, Q5_1's |m| twice more (its min term is summed apart), Q5_0's
    32 |d| (its -16 is in the integer dot, kept loose so a min-term kernel fits too))."""
    rng = np.random.default_rng(n * 10_000 + k + int(qtype))
    blocks = random_blocks(qtype, n, k, rng)
    deq = gguf.quants.dequantize(blocks, qtype).astype(np.float64)
    bound = np.abs(deq)
    if qtype in (Q.Q5_0, Q.Q5_1):
        per_block = blocks.reshape(n, k // 32, -1)
        at = 2 if qtype == Q.Q5_1 else 0
        extra = np.abs(per_block[..., at : at + 2].copy().view(np.float16).astype(np.float64))
        bound = bound + np.repeat(extra * (2 if qtype == Q.Q5_1 else 32), 32, axis=-1).reshape(n, k)
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
    check_quant_matmul(y, x, residual, deq, bound, k // 32, HALF_STEP)


@pytest.mark.parametrize(("qtype", "n", "k"), CASES, ids=[f"{q.name}-{n}x{k}" for q, n, k in CASES])
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_dense_path_matches_float64(
    kernels: cpu_kernels.CpuKernels, qtype: Q, n: int, k: int, rows: int
) -> None:
    """W dequantized as gguf-py does, met by unquantized float32 rows: within (k / 8 + 8) float32
    roundings of the sum of |x w|."""
    blocks, deq, _ = weights(qtype, n, k)
    x = activations(rows, k, torch.float32, rows + n)
    y = kernels.quant_matmul(int(qtype), torch.from_numpy(blocks), k, x, None, dense=True).double().numpy()
    x64 = x.double().numpy()
    ref = x64 @ deq.T
    tol = (k / 8 + 8) * EPS32 * (np.abs(x64) @ np.abs(deq).T) + 1e-30
    assert (np.abs(y - ref) <= tol).all(), f"worst err/tol {np.max(np.abs(y - ref) / tol):.3g}"


def test_many_rows_and_columns(kernels: cpu_kernels.CpuKernels) -> None:
    """Several panels and row chunks per thread, both thread splits: against float64 on a wider matrix."""
    for qtype in SUB32:
        blocks, deq, bound = weights(qtype, 600, 256)
        for rows in (1, 3, 70):
            x = activations(rows, 256, torch.float32, rows)
            y = kernels.quant_matmul(int(qtype), torch.from_numpy(blocks), 256, x)
            check_quant_matmul(y, x, None, deq, bound, 8, HALF_STEP)


@pytest.mark.parametrize("qtype", SUB32, ids=[t.name for t in SUB32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_get_rows_bit_exact(kernels: cpu_kernels.CpuKernels, qtype: Q, dtype: torch.dtype) -> None:
    """Dequantized rows equal gguf's float32 dequantization bit for bit (bf16: that, rounded once)."""
    n, k = SHAPES[qtype][2]
    blocks, _, _ = weights(qtype, n, k)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    ids = torch.tensor([5, 0, 32, 5, 17], dtype=torch.int64)
    got = kernels.quant_get_rows(int(qtype), torch.from_numpy(blocks), k, ids, dtype)
    assert got.dtype == dtype and got.shape == (5, k)
    assert torch.equal(got, expected[ids].to(dtype))


def test_iq4_xs_refuses_partial_super_blocks(kernels: cpu_kernels.CpuKernels) -> None:
    """IQ4_XS's k must be whole 256-weight blocks: 0 activation bytes, a ValueError from the binding."""
    assert kernels._quant_act_row_bytes(int(Q.IQ4_XS), 512) == 16 * 72
    assert kernels._quant_act_row_bytes(int(Q.IQ4_XS), 96) == 0
    blocks, _, _ = weights(Q.IQ4_XS, 7, 512)
    with pytest.raises(ValueError):
        kernels.quant_matmul(int(Q.IQ4_XS), torch.from_numpy(blocks)[:, :68], 128, torch.randn(1, 128))
