"""BF16 weights at many rows on vdpbf16ps (csrc/quant_bf16x.c, the type code BF16 | A8): against float64
products over gguf-py's dequantization of the same bytes, tightly against the activations rounded to
bf16 as the kernel rounds them and loosely against the activations as given (the precision the
kernel trades: 2^-8 of each |x w|), on odd shapes and 1-256 rows; and quant.py's tables sending a
BF16 Linear's many rows there exactly where the build has the kernel."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.kind import CpuKind
from gpu_worker.backends.cpu.layouts import A8
from gpu_worker.backends.cpu.quant import NEVER, a8_min_rows, dense_min_rows
from gpu_worker.weights.formats import QuantBlocks
from tests.gpu_worker.quant_reference import EPS32, activations
from tests.gpu_worker.test_quant_f16 import weights

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

BF16X = int(Q.BF16) | A8
WITH_VDPBF16PS = {CpuKind.AVX512_BF16, CpuKind.AMX}  # the builds with -mavx512bf16 (build.py)
BF16_UNIT = 2.0**-8  # bf16's unit roundoff (8-bit significands, nearest even)
# n not a multiple of the 4-column register tile nor the 16-column unit; k whole groups of 32, odd counts
SHAPES = [(1, 32), (7, 96), (33, 640), (21, 1088)]


def check(y: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, deq: np.ndarray) -> None:
    """(a) Tight: x rounded to bf16 (nearest even) is what the kernel multiplies; its products are
    exact in float32 and each output sums them in float32 lanes (k / 16 pair steps) and then across
    16 lanes: within (k / 16 + 8) float32 roundings of sum |x w|, plus the output's rounding.
    (b) Loose, against x as given: (a) plus 2^-8 of sum |x w| (each x moved by at most 2^-8 |x|)."""
    k = x.shape[1]
    x64 = x.double().numpy()
    xb = x.to(torch.bfloat16).double().numpy()
    res = residual.double().numpy() if residual is not None else 0.0
    out_round = 2.0**-8 if y.dtype == torch.bfloat16 else EPS32
    got = y.double().numpy()
    ref_b = res + xb @ deq.T
    tol_a = (k / 16 + 8) * EPS32 * (np.abs(xb) @ np.abs(deq).T) + out_round * np.abs(ref_b)
    tol_a = tol_a + EPS32 * np.abs(res) + 1e-30
    err_a = np.abs(got - ref_b)
    assert (err_a <= tol_a).all(), f"tight: worst err/tol {np.max(err_a / tol_a):.3g}"
    ref = res + x64 @ deq.T
    tol_b = BF16_UNIT * (np.abs(x64) @ np.abs(deq).T) + tol_a + out_round * np.abs(ref)
    err_b = np.abs(got - ref)
    assert (err_b <= tol_b).all(), f"loose: worst err/tol {np.max(err_b / tol_b):.3g}"


def test_built_where_the_cpu_has_vdpbf16ps(kernels: cpu_kernels.CpuKernels) -> None:
    assert kernels.quant_supported(BF16X) == (kernels.kind in WITH_VDPBF16PS)


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 13, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_matmul_matches_float64(
    kernels: cpu_kernels.CpuKernels, n: int, k: int, rows: int, dtype: torch.dtype
) -> None:
    if not kernels.quant_supported(BF16X):
        pytest.skip(f"no vdpbf16ps in the {kernels.kind.value} build")
    blocks, deq = weights(Q.BF16, n, k)
    x = activations(rows, k, dtype, rows * 7 + n)
    gen = torch.Generator().manual_seed(n)
    residual = torch.randn(rows, n, generator=gen).to(dtype) if rows in (2, 13) else None
    y = kernels.quant_matmul(BF16X, torch.from_numpy(blocks), k, x, residual)
    assert y.shape == (rows, n) and y.dtype == dtype
    check(y, x, residual, deq)


@pytest.mark.parametrize("rows", [14, 40, 256])
def test_long_rows_in_chunks_match_float64(kernels: cpu_kernels.CpuKernels, rows: int) -> None:
    """k past 2048 (64 blocks): from 14 rows the tile takes k in chunks, each (row, column) pair's lanes
    kept between them, in row blocks of at most 32 (40 rows: two of 20); n = 23 leaves a short column
    tile. Summed in the same order as one pass, so the float64 bounds hold as they do above."""
    if not kernels.quant_supported(BF16X):
        pytest.skip(f"no vdpbf16ps in the {kernels.kind.value} build")
    n, k = 23, 4160  # 130 blocks: chunks of 64, 64, 2
    blocks, deq = weights(Q.BF16, n, k)
    x = activations(rows, k, torch.float32, rows)
    residual = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows))
    y = kernels.quant_matmul(BF16X, torch.from_numpy(blocks), k, x, residual)
    check(y, x, residual, deq)


def test_ties_round_to_even(kernels: cpu_kernels.CpuKernels) -> None:
    """Activations halfway between two bf16 values: rounded to the even one (as torch rounds), not
    truncated nor rounded up; weights of 1.0 make each output one activation."""
    if not kernels.quant_supported(BF16X):
        pytest.skip(f"no vdpbf16ps in the {kernels.kind.value} build")
    k = 32
    eye = torch.eye(k, dtype=torch.bfloat16).view(torch.uint8).reshape(k, 2 * k).contiguous()
    base = torch.arange(1, k + 1, dtype=torch.float32) * 2.0**-3 + 1.0  # bf16 steps of 2^-7 near 1
    x = torch.stack([base, base + 2.0**-8, base - 2.0**-9])  # ties and a value below half a step
    y = kernels.quant_matmul(BF16X, eye, k, x)
    assert torch.equal(y, x.to(torch.bfloat16).float())


def test_tables_send_many_rows_where_built(kernels: cpu_kernels.CpuKernels) -> None:
    """A BF16 Linear from 2 rows on the vdpbf16ps tile where the build has it; never on the dense path
    on the AVX-512 kinds (without vdpbf16ps quant_f16.c's float32 tile); avx2 from 12 rows, portable 2."""
    blocks, _ = weights(Q.BF16, 7, 96)
    part = QuantBlocks(int(Q.BF16), torch.from_numpy(blocks), 96)
    assert a8_min_rows(kernels, part) == (2 if kernels.kind in WITH_VDPBF16PS else NEVER)
    avx512 = WITH_VDPBF16PS | {CpuKind.AVX512, CpuKind.AVX512_VNNI}
    want = NEVER if kernels.kind in avx512 else 12 if kernels.kind == CpuKind.AVX2 else 2
    assert dense_min_rows(kernels.kind, part) == want
