"""MXFP4 blocks (gpt-oss's experts; csrc/quant_sub32.c): the integer path (one row and many), the dense
path and the row lookup against float64 products over gguf-py's dequantization of the same random
blocks, on every CPU kind this machine runs; and the repacking of an HF checkpoint's ``*_blocks`` /
``*_scales`` into ggml's blocks, against transformers' own dequantization of them."""

from __future__ import annotations

import functools
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.weights.mxfp4 import ggml_mxfp4
from tests.gpu_worker.quant_reference import EPS32, HALF_STEP, activations, check_quant_matmul

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

# (n, k): n around the tiles (4 weight rows at one activation row, 2 at several), k from one block to
# past a 32-block scale chunk.
SHAPES = [(1, 32), (7, 96), (33, 640), (100, 1088)]


@functools.cache
def weights(n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(random MXFP4 blocks [n, row bytes] with exponents around 2^-5 (and a few subnormal and large
    ones), their float64 dequantization [n, k] by gguf-py)."""
    rng = np.random.default_rng(n * 10_000 + k)
    blocks = rng.integers(0, 256, (n, k // 32, 17), dtype=np.uint8)
    blocks[..., 0] = rng.integers(118, 128, (n, k // 32))
    blocks[0, 0, 0], blocks[-1, -1, 0] = 1, 140  # a subnormal scale, a large one
    blocks = blocks.reshape(n, -1)
    return blocks, gguf.quants.dequantize(blocks, Q.MXFP4).astype(np.float64)


@pytest.mark.parametrize(("n", "k"), SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_integer_path_matches_float64(
    kernels: cpu_kernels.CpuKernels, n: int, k: int, rows: int, dtype: torch.dtype
) -> None:
    blocks, deq = weights(n, k)
    x = activations(rows, k, dtype, rows * 7 + n)
    residual = (
        torch.randn(rows, n, generator=torch.Generator().manual_seed(n)).to(dtype) if rows == 7 else None
    )
    assert kernels.quant_supported(int(Q.MXFP4))
    y = kernels.quant_matmul(int(Q.MXFP4), torch.from_numpy(blocks), k, x, residual)
    assert y.shape == (rows, n) and y.dtype == dtype
    check_quant_matmul(y, x, residual, deq, np.abs(deq), k // 32, HALF_STEP)


@pytest.mark.parametrize(("n", "k"), SHAPES[1:], ids=[f"{n}x{k}" for n, k in SHAPES[1:]])
def test_dense_path_matches_float64(kernels: cpu_kernels.CpuKernels, n: int, k: int) -> None:
    """W dequantized as gguf-py does, met by unquantized float32 rows: within (k / 8 + 8) float32
    roundings of the sum of |x w|."""
    blocks, deq = weights(n, k)
    x = activations(9, k, torch.float32, n)
    y = kernels.quant_matmul(int(Q.MXFP4), torch.from_numpy(blocks), k, x, None, dense=True).double().numpy()
    x64 = x.double().numpy()
    tol = (k / 8 + 8) * EPS32 * (np.abs(x64) @ np.abs(deq).T) + 1e-30
    assert (np.abs(y - x64 @ deq.T) <= tol).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_get_rows_bit_exact(kernels: cpu_kernels.CpuKernels, dtype: torch.dtype) -> None:
    """Dequantized rows equal gguf's float32 dequantization bit for bit (bf16: that, rounded once)."""
    blocks, _ = weights(33, 640)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, Q.MXFP4))
    ids = torch.tensor([5, 0, 32, 5, 17], dtype=torch.int64)
    got = kernels.quant_get_rows(int(Q.MXFP4), torch.from_numpy(blocks), 640, ids, dtype)
    assert torch.equal(got, expected[ids].to(dtype))


def test_hf_blocks_repack_to_ggml_blocks() -> None:
    """An HF checkpoint's [E, rows, k / 32, 16] blocks and [E, rows, k / 32] scales, repacked, give by
    gguf-py's dequantization exactly what transformers' dequantization gives (its [E, k, rows])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(3)
    hf_blocks = torch.from_numpy(rng.integers(0, 256, (3, 10, 4, 16), dtype=np.uint8))
    hf_scales = torch.from_numpy(rng.integers(110, 135, (3, 10, 4), dtype=np.uint8))
    expected = convert_moe_packed_tensors(hf_blocks, hf_scales, dtype=torch.float32).transpose(1, 2)
    packed = ggml_mxfp4(hf_blocks, hf_scales)  # [E * rows, row bytes]
    assert packed.shape == (30, 4 * 17) and packed.dtype == torch.uint8
    got = gguf.quants.dequantize(packed.numpy(), Q.MXFP4).reshape(3, 10, 128)
    assert torch.equal(torch.from_numpy(got), expected)
