"""F16 and BF16 weights computed as they lie (csrc/quant_f16.c): the one-row tile, the many-row tile and
the dense path against float64 products over gguf-py's dequantization of the same bytes, and the row
lookup bit for bit, on every CPU kind this machine runs."""

from __future__ import annotations

import functools
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.hugepages import HugePageArena, arena_bytes
from gpu_worker.backends.cpu.layouts import in_arena, place
from gpu_worker.weights.formats import FILE_LAYOUT, QuantBlocks
from tests.gpu_worker.quant_reference import EPS32, activations

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

SIXTEEN = [Q.F16, Q.BF16]
SHAPES = [(1, 32), (7, 96), (33, 640), (100, 1088)]


@functools.cache
def weights(qtype: Q, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 [n, 2 k] of the weights in ``qtype``, their float64 values [n, k])."""
    rng = np.random.default_rng(n * 10_000 + k + int(qtype))
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1))).astype(np.float32)
    blocks = np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(n, 2 * k)
    return blocks, gguf.quants.dequantize(blocks, qtype).astype(np.float64)


def check(y: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, deq: np.ndarray) -> None:
    """Float32 sums of exact products (x read as it is, the weights widened exactly): within (k / 8 + 8)
    float32 roundings of sum |x w|, plus the final rounding to y's dtype."""
    k = x.shape[1]
    x64 = x.double().numpy()
    res = residual.double().numpy() if residual is not None else 0.0
    ref = res + x64 @ deq.T
    out_round = 2.0**-8 if y.dtype == torch.bfloat16 else EPS32
    tol = (k / 8 + 8) * EPS32 * (np.abs(x64) @ np.abs(deq).T) + out_round * np.abs(ref) + 1e-30
    err = np.abs(y.double().numpy() - ref)
    assert (err <= tol).all(), f"worst err/tol {np.max(err / tol):.3g}"


@pytest.mark.parametrize("qtype", SIXTEEN, ids=[t.name for t in SIXTEEN])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dense", [False, True], ids=["tile", "dense"])
def test_matmul_matches_float64(
    kernels: cpu_kernels.CpuKernels, qtype: Q, n: int, k: int, rows: int, dtype: torch.dtype, dense: bool
) -> None:
    blocks, deq = weights(qtype, n, k)
    x = activations(rows, k, dtype, rows * 7 + n)
    residual = (
        torch.randn(rows, n, generator=torch.Generator().manual_seed(n)).to(dtype) if rows == 3 else None
    )
    assert kernels.quant_supported(int(qtype))
    y = kernels.quant_matmul(int(qtype), torch.from_numpy(blocks), k, x, residual, dense=dense)
    assert y.shape == (rows, n) and y.dtype == dtype
    check(y, x, residual, deq)


@pytest.mark.parametrize("qtype", SIXTEEN, ids=[t.name for t in SIXTEEN])
def test_get_rows_bit_exact(kernels: cpu_kernels.CpuKernels, qtype: Q) -> None:
    blocks, deq = weights(qtype, 33, 640)
    ids = torch.tensor([5, 0, 32, 5, 17], dtype=torch.int64)
    got = kernels.quant_get_rows(int(qtype), torch.from_numpy(blocks), 640, ids, torch.float32)
    assert torch.equal(got, torch.from_numpy(deq[ids.numpy()].astype(np.float32)))


def test_rows_not_whole_groups_are_refused(kernels: cpu_kernels.CpuKernels) -> None:
    """The kernels take k in groups of 32 (the loader widens other 16-bit rows at load)."""
    assert kernels._quant_act_row_bytes(int(Q.F16), 64) == 64 * 4
    assert kernels._quant_act_row_bytes(int(Q.BF16), 48) == 0


def test_a_split_of_16_bit_rows_falls_on_whole_groups() -> None:
    """Tensor parallel's share of a row-parallel F16 / BF16 weight: whole groups of 32 (what the kernels
    take), else refused at start as a K-quant's partial blocks are."""
    blocks, _ = weights(Q.BF16, 7, 96)
    held = QuantBlocks(int(Q.BF16), torch.from_numpy(blocks), 96)
    share = held.column_span(32, 64)
    assert share.cols == 64 and torch.equal(share.data, torch.from_numpy(blocks[:, 64:192]))
    with pytest.raises(ValueError, match="blocks of 32"):
        held.column_span(0, 48)


@pytest.mark.parametrize("qtype", SIXTEEN, ids=[t.name for t in SIXTEEN])
def test_sixteen_bit_rows_are_copied_into_the_arena_as_they_are(qtype: Q) -> None:
    """The backend holds F16 / BF16 rows in its huge-page arena, in the file's layout (the one-row tile
    streams them there), whatever their row count; the other types only where they re-lay."""
    blocks = QuantBlocks(int(qtype), torch.from_numpy(weights(qtype, 7, 96)[0]), 96)
    assert in_arena(blocks)
    arena = HugePageArena(arena_bytes([blocks.data.numel()]))
    slot = arena.take(tuple(blocks.data.shape))
    placed = place(blocks, slot)
    assert placed.layout == FILE_LAYOUT and placed.type == blocks.type and placed.cols == 96
    assert placed.data.data_ptr() == slot.data_ptr() and torch.equal(placed.data, blocks.data)
    seven_q8 = QuantBlocks(int(Q.Q8_0), torch.zeros(7, 34, dtype=torch.uint8), 32)
    assert not in_arena(seven_q8)


@pytest.mark.parametrize("qtype", SIXTEEN, ids=[t.name for t in SIXTEEN])
@pytest.mark.parametrize(("n", "k"), [(2, 4128), (5, 8192), (37, 4160), (4, 4192)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_row_past_4096_is_each_row_alone(
    kernels: cpu_kernels.CpuKernels, qtype: Q, n: int, k: int, threads: int
) -> None:
    """Past k = 4096 the one-row tile (AVX-512 and AVX2 builds) reads a thread's rows two at a time
    (quant_f16.c's ROW1_PAIR_K; the AVX-512 builds' pair on 256-bit halves, rows2_halves): each output
    equals its row's in a call of that row alone (one row at a time, the zmm loop there), bit for bit,
    and the float64 bound holds, at any split of the rows over threads (odd shares included), with 1, 2
    and 3 blocks past the loop's steps of 4 (k = 4128, 4160, 4192)."""
    blocks, deq = weights(qtype, n, k)
    x = activations(1, k, torch.float32, n + k)
    w = torch.from_numpy(blocks)
    kept = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = kernels.quant_matmul(int(qtype), w, k, x)
        rows = [kernels.quant_matmul(int(qtype), w[j : j + 1].contiguous(), k, x) for j in range(n)]
        alone = torch.cat(rows, 1)
    finally:
        torch.set_num_threads(kept)
    assert torch.equal(y.view(torch.int32), alone.view(torch.int32))
    check(y, x, None, deq)
