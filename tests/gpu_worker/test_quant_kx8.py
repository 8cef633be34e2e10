"""The K-quants held with their rows interleaved by 8 (csrc/quant_kx8.c, made by
backends/cpu/layouts.py): the layout itself, and every kernel that reads it (the integer path at
1-256 rows, the dense path, the row lookup) against float64 on gguf-py's dequantization of the
file's blocks (random blocks with sane scales: gguf-py cannot make K-quants), on every CPU kind
this machine runs."""

from __future__ import annotations

import ctypes
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu import kind as cpu_kind
from gpu_worker.backends.cpu.layouts import (
    X8,
    X8_LAYOUT,
    deinterleave_rows,
    dequantize,
    interleave_rows,
    kernel_type,
)
from gpu_worker.weights.formats import QuantBlocks
from tests.gpu_worker.quant_reference import EPS32
from tests.gpu_worker.test_quant_k_kernels import K_TYPES, QK, activations, check, weights

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

# (n, k): one group and one block; three groups of 2 and 6 blocks; a thread split of 25 groups; 17
# blocks (a row of the 1B shape's ffn has 32).
SHAPES = [(8, 256), (24, 512), (48, 1536), (200, 256), (16, 17 * QK)]


def held(qtype: Q, n: int, k: int) -> tuple[QuantBlocks, np.ndarray, np.ndarray]:
    """(the blocks interleaved, their float64 dequantization, the per-weight bound) for ``weights``."""
    blocks, deq, bound = weights(qtype, n, k)
    x8 = interleave_rows(QuantBlocks(int(qtype), torch.from_numpy(blocks), k))
    assert x8.layout == X8_LAYOUT and kernel_type(x8) == int(qtype) | X8
    return x8, deq, bound


@pytest.mark.parametrize("qtype", K_TYPES, ids=[t.name for t in K_TYPES])
def test_layout_is_the_one_the_kernels_read(qtype: Q) -> None:
    """Same bytes, undone exactly; the fields of group 1's block 1 where csrc/quant_kx8.c reads them."""
    blocks, _, _ = weights(qtype, 24, 512)
    x8 = interleave_rows(QuantBlocks(int(qtype), torch.from_numpy(blocks), 512))
    assert x8.data.shape == blocks.shape and torch.equal(deinterleave_rows(x8), torch.from_numpy(blocks))
    bb = blocks.shape[1] // 2
    got = x8.data.numpy()[8:16].reshape(-1)[8 * bb : 16 * bb]  # group 1, block 1
    rows = blocks[8:16, bb : 2 * bb]  # the file's rows 8..15, block 1

    def chunked(file_bytes: np.ndarray) -> np.ndarray:  # [8 rows, m] -> chunks of 4 bytes per row in turn
        return file_bytes.reshape(8, -1, 4).transpose(1, 0, 2).reshape(-1)

    if qtype == Q.Q6_K:
        assert (got[:16] == rows[:, 208:210].reshape(-1)).all()  # d
        # (h, half, pair p, sub-block of the pair q): scale 8h + 4p + 2q + half of the 8 rows
        scale = [
            8 * h + 4 * p + 2 * q + half for h in (0, 1) for half in (0, 1) for p in (0, 1) for q in (0, 1)
        ]
        assert (got[16:144] == rows[:, 192:208][:, scale].T.reshape(-1)).all()
        assert (got[144:1168] == chunked(rows[:, :128])).all()  # ql
        assert (got[1168:] == chunked(rows[:, 128:192])).all()  # qh
    else:
        assert (got[:32] == rows[:, :4].reshape(8, 2, 2).transpose(1, 0, 2).reshape(-1)).all()  # d, dmin
        assert (got[32:128] == chunked(rows[:, 4:16])).all()  # the 3 scale words
        assert (got[-1024:] == chunked(rows[:, -128:])).all()  # qs
        if qtype == Q.Q5_K:
            assert (got[128:384] == chunked(rows[:, 16:48])).all()  # qh
    odd = QuantBlocks(int(qtype), torch.from_numpy(weights(qtype, 7, 512)[0]), 512)
    assert interleave_rows(odd) is odd, "7 rows stay as the file holds them"


@pytest.mark.parametrize("qtype", K_TYPES, ids=[t.name for t in K_TYPES])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 32, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_integer_path_matches_float64(
    kernels: cpu_kernels.CpuKernels, qtype: Q, n: int, k: int, rows: int, dtype: torch.dtype
) -> None:
    x8, deq, bound = held(qtype, n, k)
    x = activations(rows, k, rows * 7 + n, dtype)
    residual = torch.randn(rows, n).to(dtype) if rows % 2 else None
    y = kernels.quant_matmul(kernel_type(x8), x8.data, k, x, residual)
    assert y.shape == (rows, n) and y.dtype == dtype
    check(y, x, residual, deq, bound)


@pytest.mark.parametrize("qtype", K_TYPES, ids=[t.name for t in K_TYPES])
@pytest.mark.parametrize(("n", "k"), SHAPES[1:])
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_dense_path_matches_float64(
    kernels: cpu_kernels.CpuKernels, qtype: Q, n: int, k: int, rows: int
) -> None:
    """W dequantized a group of 8 rows at a time (each row's blocks rebuilt): float32 sums of exact
    products, within (k / 8 + 8) float32 roundings of the sum of |x w| (test_quant_dense.py's bound)."""
    x8, deq, _ = held(qtype, n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + n))
    residual = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows))
    y = kernels.quant_matmul(kernel_type(x8), x8.data, k, x, residual, dense=True).double().numpy()
    x64, res64 = x.double().numpy(), residual.double().numpy()
    ref = res64 + x64 @ deq.T
    tol = (k / 8 + 8) * EPS32 * (np.abs(x64) @ np.abs(deq).T) + EPS32 * (np.abs(ref) + np.abs(res64))
    assert (np.abs(y - ref) <= tol + 1e-30).all()


@pytest.mark.parametrize("qtype", K_TYPES, ids=[t.name for t in K_TYPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_row_lookup_is_bit_exact(kernels: cpu_kernels.CpuKernels, qtype: Q, dtype: torch.dtype) -> None:
    """Rows of every slot of several groups equal gguf's dequantization of the file's blocks."""
    x8, _, _ = held(qtype, 24, 512)
    expected = torch.from_numpy(gguf.quants.dequantize(weights(qtype, 24, 512)[0], qtype))
    ids = torch.tensor([5, 0, 23, 8, 15, 16, 7, 5], dtype=torch.int64)
    got = kernels.quant_get_rows(kernel_type(x8), x8.data, 512, ids, dtype)
    assert torch.equal(got, expected[ids].to(dtype))
    assert torch.equal(dequantize(x8), expected)


@pytest.mark.parametrize("qtype", K_TYPES, ids=[t.name for t in K_TYPES])
def test_one_row_gives_the_bits_it_has_beside_another(kernels: cpu_kernels.CpuKernels, qtype: Q) -> None:
    """One row takes a panel of all its thread's columns (csrc/quant.c's ROW1_PANEL; on avx2 Q4_K and
    Q6_K run the maddubs tile on the row split once, quant_kx8.c's kx8_row1), 400 here against a
    many-row panel's 128 at most, k 4096 as the ffn's down (k 8192) has 16 and more blocks: the
    bits the row has in a 2-row call (the 16-bit tile), and a residual added as float32 adds it."""
    n, k = 400, 16 * QK
    x8, _, _ = held(qtype, n, k)
    t = kernel_type(x8)
    x = activations(2, k, 5, torch.float32)
    two = kernels.quant_matmul(t, x8.data, k, x)
    for i in range(2):
        assert torch.equal(kernels.quant_matmul(t, x8.data, k, x[i : i + 1]), two[i : i + 1])
    residual = torch.randn(1, n, generator=torch.Generator().manual_seed(1))
    assert torch.equal(kernels.quant_matmul(t, x8.data, k, x[:1], residual), two[:1] + residual)


def test_rows_not_a_multiple_of_8_are_refused(kernels: cpu_kernels.CpuKernels) -> None:
    blocks, _, _ = weights(Q.Q4_K, 7, 256)
    x = torch.randn(2, 256)
    for dense in (False, True):
        with pytest.raises(ValueError, match=r"RV_ERR_X8_ROWS \(5\)"):
            kernels.quant_matmul(int(Q.Q4_K) | X8, torch.from_numpy(blocks), 256, x, dense=dense)


@pytest.mark.parametrize("qtype", K_TYPES, ids=[t.name for t in K_TYPES])
def test_weight_prefetch_hint_changes_no_bit(kernels: cpu_kernels.CpuKernels, qtype: Q) -> None:
    """The few-row tiles' weight prefetch (common.h's weight_prefetch_nta, as the loader set it from
    kind.weight_prefetch_nta) is a hint: either way the same bits at 1 and 3 rows."""
    hint = ctypes.c_int.in_dll(ctypes.CDLL(str(kernels.path)), "weight_prefetch_nta")
    assert hint.value == int(cpu_kind.weight_prefetch_nta())
    x8, _, _ = held(qtype, 48, 1536)
    try:
        for rows in (1, 3):
            x = activations(rows, 1536, rows, torch.float32)
            ys = []
            for nta in (0, 1):
                hint.value = nta
                ys.append(kernels.quant_matmul(kernel_type(x8), x8.data, 1536, x))
            assert torch.equal(ys[0], ys[1])
    finally:
        hint.value = int(cpu_kind.weight_prefetch_nta())
