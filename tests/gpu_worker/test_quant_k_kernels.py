"""The K-quant kernels (csrc/quant_k.c: Q4_K, Q5_K, Q6_K) through the quantized matmul and row lookup
(csrc/quant.c), against float64 references built from gguf-py's own dequantization of the same blocks,
on every CPU kind this machine runs. gguf-py cannot make K-quant blocks, so they are random bytes with
sane scales: fp16 d (and dmin) of realistic magnitudes, random 6-bit / int8 scales, random quants."""

from __future__ import annotations

import functools
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.backends.cpu import kernels as cpu_kernels
from tests.gpu_worker.quant_reference import check_quant_matmul

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

K_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
BLOCK_BYTES = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}
QK = 256
ACT_BLOCK_BYTES = 8 * 72  # per 256 weights: 8 act_block16 of float d, float s, int16 q[32]
# (n, k): n around the kernel's panels (4 weight rows; 2 per register tile at several activation
# rows) and the driver's 8-column units; k of 1, 2 and 6 blocks.
SHAPES = [(1, 256), (7, 512), (33, 1536), (100, 512)]


def random_blocks(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """Random blocks of ``qtype`` as uint8 [n, row bytes]: every quant, scale and min byte random,
    d (and dmin) fp16 in [1e-5, 1e-3] (weights up to ~0.1 in Q4_K), a few of them subnormal or
    negative (Q6_K's d), so that the fp16 conversion is exercised too."""
    rng = np.random.default_rng(seed)
    nb = n * k // QK
    blocks = rng.integers(0, 256, size=(nb, BLOCK_BYTES[qtype]), dtype=np.uint8)

    def fp16s() -> np.ndarray:
        d = rng.uniform(1e-5, 1e-3, size=nb)
        d[rng.random(nb) < 0.05] = 3e-7  # fp16 subnormal
        return d.astype(np.float16).view(np.uint8).reshape(nb, 2)

    if qtype == Q.Q6_K:
        d = fp16s().view(np.float16)
        d[rng.random(nb) < 0.3] *= -1
        blocks[:, 208:210] = d.view(np.uint8)
    else:
        blocks[:, 0:2] = fp16s()
        blocks[:, 2:4] = fp16s()
    return blocks.reshape(n, k // QK * BLOCK_BYTES[qtype])


@functools.cache
def weights(qtype: Q, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(blocks uint8 [n, row bytes], gguf's float64 dequantization [n, k], a bound [n, k] on the
    magnitudes of the terms the kernel sums per weight). Q4_K and Q5_K's kernel sums d * sc * sum(q x)
    and dmin * m * sum(x) apart, so per weight the terms are at most d sc q + dmin m; Q6_K's widens
    q - 32 into the integers, so its term is the weight itself, |d sc (q - 32)|."""
    blocks = random_blocks(qtype, n, k, seed=n * 10_000 + k + int(qtype))
    deq = gguf.quants.dequantize(blocks, qtype).astype(np.float64)
    if qtype == Q.Q6_K:
        bound = np.abs(deq)
    else:
        per_block = blocks.reshape(n * k // QK, BLOCK_BYTES[qtype])
        dmin = np.abs(per_block[:, 2:4].copy().view(np.float16).astype(np.float64))
        # d sc q + dmin m = w + 2 dmin m <= |w| + 2 dmin * 63
        bound = np.abs(deq.reshape(-1, QK)) + 2 * 63 * dmin
    return blocks, deq, bound.reshape(n, k)


def check(
    y: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, deq: np.ndarray, bound: np.ndarray
) -> None:
    """The shared check: per 256-weight block two float terms a lane are summed (the scaled dots and
    the mins; Q6_K: the 16-halves of two sub-blocks); loose half step 0.506 d_x (rounding plus the
    float32 errors of the scale, x * inv and d_x: 3 * 2^-24 * 32767 < 0.006 steps)."""
    check_quant_matmul(y, x, residual, deq, bound, x.shape[1] // QK, 0.506)


def activations(rows: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """x [rows, k] of ``dtype``, rows strided (a slice of wider rows), an outlier per row so blocks
    differ in scale, and (k > 256) one all-zero block (d_x = 0)."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, k + 5, generator=gen) * torch.rand(rows, 1, generator=gen) * 3
    wide[:, 3] *= 20
    if k > QK:
        wide[0, 2 + QK : 2 + 2 * QK] = 0
    return wide.to(dtype)[:, 2 : k + 2]


@pytest.mark.parametrize("qtype", K_TYPES, ids=[t.name for t in K_TYPES])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 32, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_quant_k_matmul_matches_float64(
    kernels: cpu_kernels.CpuKernels,
    qtype: Q,
    n: int,
    k: int,
    rows: int,
    dtype: torch.dtype,
    with_residual: bool,
) -> None:
    blocks, deq, bound = weights(qtype, n, k)
    x = activations(rows, k, rows * 7 + n, dtype)
    gen = torch.Generator().manual_seed(rows + n)
    residual = torch.randn(rows, n, generator=gen).to(dtype) if with_residual else None
    y = kernels.quant_matmul(int(qtype), torch.from_numpy(blocks), k, x, residual)
    assert y.shape == (rows, n) and y.dtype == dtype
    check(y, x, residual, deq, bound)


@pytest.mark.parametrize("qtype", K_TYPES, ids=[t.name for t in K_TYPES])
def test_quant_k_matmul_long_rows(kernels: cpu_kernels.CpuKernels, qtype: Q) -> None:
    """k of 17 blocks (a row group of 4 takes them in chunks of 8, the last partial; 1 row in one
    chunk of up to 32) and enough columns for several of the driver's panels per thread, at row
    counts that leave partial row groups (5 = 4 + 1, 40 = 32 + 8 over two row chunks)."""
    n, k = 300, 17 * QK
    blocks, deq, bound = weights(qtype, n, k)
    for rows in (1, 5, 32, 40):
        x = activations(rows, k, rows, torch.float32)
        check(kernels.quant_matmul(int(qtype), torch.from_numpy(blocks), k, x), x, None, deq, bound)


@pytest.mark.parametrize("qtype", K_TYPES, ids=[t.name for t in K_TYPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_quant_k_get_rows_bit_exact(kernels: cpu_kernels.CpuKernels, qtype: Q, dtype: torch.dtype) -> None:
    """Dequantized rows equal gguf's float32 dequantization bit for bit (bf16: that, rounded once)."""
    blocks, _, _ = weights(qtype, 33, 1536)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    ids = torch.tensor([5, 0, 32, 5, 17], dtype=torch.int64)
    got = kernels.quant_get_rows(int(qtype), torch.from_numpy(blocks), 1536, ids, dtype)
    assert got.dtype == dtype and got.shape == (5, 1536)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), expected[ids].to(dtype).view(bits))


def test_quant_k_supported(kernels: cpu_kernels.CpuKernels) -> None:
    """The K-quants are supported, with k a whole number of 256-blocks only."""
    for qtype in K_TYPES:
        assert kernels.quant_supported(int(qtype))
        assert kernels._quant_act_row_bytes(int(qtype), 512) == 2 * ACT_BLOCK_BYTES
        assert kernels._quant_act_row_bytes(int(qtype), 576) == 0
        with pytest.raises(ValueError):
            kernels.quant_matmul(int(qtype), torch.zeros(1, 2 * BLOCK_BYTES[qtype], dtype=torch.uint8), 576,
                                 torch.zeros(1, 576))  # fmt: skip
