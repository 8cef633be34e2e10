"""The interleaved types (the K-quants; the legacy Q4_0, Q4_1, Q8_0) met by 8-bit activations
(csrc/quant.h's act_block8, csrc/quant_kx8.c's vpdpbusd tiles, maddubs + madd without VNNI: the
many-row path of the AVX-512 and AVX2 builds). The quantization itself (its bound per value, the
residual pass where a block's absmax stands far above its mean, the sums), the tiles against
float64 on gguf-py's dequantization of the file's blocks, a row's output whatever rows are beside
it, the same bits on every kind that has the tiles, and QuantLinear, the one-call decode's plan and
the experts taking them from A8_MIN_ROWS rows."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.kind import CpuKind
from gpu_worker.backends.cpu.layouts import A8, interleave_rows, kernel_type
from gpu_worker.backends.cpu.quant import A8_MIN_ROWS, NEVER, QuantLinear, a8_min_rows
from gpu_worker.weights.formats import QuantBlocks, QuantizedWeight
from tests.gpu_worker import test_quant_kernels as legacy
from tests.gpu_worker.helpers import KINDS
from tests.gpu_worker.quant_reference import EPS32
from tests.gpu_worker.test_quant_k_kernels import K_TYPES, QK, activations, weights

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

ACT8 = np.dtype(
    [("d", "<f4", 8), ("s", "<f4", 8), ("qoff", "<i4", 16), ("roff", "<i4", 16), ("two", "<i4"),
     ("pad", "<i4", 3), ("q", "i1", 256), ("r", "i1", 256)]
)  # fmt: skip
SPREAD = 6.0  # csrc/quant.h's ACT8_SPREAD
SHAPES = [(16, 256), (24, 512), (48, 1536), (16, 17 * QK)]  # one pair of groups; a lone group; 17 blocks
A8_TYPES = [*K_TYPES, *legacy.LEGACY]


def kinds_with_tiles() -> list[CpuKind]:
    return [kind for kind in KINDS if A8_MIN_ROWS[kind]]


@pytest.fixture(scope="module", params=kinds_with_tiles(), ids=[kind.value for kind in kinds_with_tiles()])
def kernels(request: pytest.FixtureRequest) -> cpu_kernels.CpuKernels:
    """The library of each kind this CPU runs that has the 8-bit tiles (none: every test skips)."""
    kind: CpuKind = request.param
    return cpu_kernels.CpuKernels(cpu_kernels.build(kind), kind)


def quantized(kernels: cpu_kernels.CpuKernels, x: torch.Tensor) -> np.ndarray:
    """Each row of x (float32 as the kernel widens it) as act_block8 structs: [rows, k / 256]."""
    rows = [kernels.quantize_act8(row.float().contiguous()).numpy() for row in x]
    return np.stack([row.reshape(-1).view(ACT8) for row in rows])


def values(blocks: np.ndarray) -> np.ndarray:
    """float64 [rows, k]: d q + d / 128 r per 32 values, what the tiles multiply."""
    d = blocks["d"].astype(np.float64).repeat(32, axis=-1)  # [rows, k / 256, 256]
    got = d * blocks["q"] + d / 128 * blocks["r"]
    return got.reshape(blocks.shape[0], -1)


def held(qtype: Q, n: int, k: int) -> tuple[QuantBlocks, np.ndarray, np.ndarray]:
    """(blocks interleaved, float64 dequantization, per-weight bound on the terms the 8-bit tiles
    sum). Q6_K's tiles multiply the unsigned q and subtract 32 d sc times the activation's sum, so
    its terms are |d sc| (q + 32) <= |w| + 64 |d sc|; Q8_0's likewise q + 128 and 128 d: |w| + 256
    |d|. (Q4_0's d q and 8 d, Q4_1's d q and m: within the legacy tests' bound.)"""
    if qtype in legacy.LEGACY:
        blocks, deq, bound = legacy.weights(qtype, n, k)
        if qtype == Q.Q8_0:
            d = blocks.reshape(n, k // 32, 34)[..., :2].copy().view(np.float16).astype(np.float64)
            bound = np.abs(deq) + 256 * np.abs(d).repeat(32, axis=-1).reshape(n, k)
        return interleave_rows(QuantBlocks(int(qtype), torch.from_numpy(blocks), k)), deq, bound
    blocks, deq, bound = weights(qtype, n, k)
    if qtype == Q.Q6_K:
        per_block = blocks.reshape(-1, 210)
        d = per_block[:, 208:210].copy().view(np.float16).astype(np.float64)  # [blocks, 1]
        sc = per_block[:, 192:208].view(np.int8).astype(np.float64)  # [blocks, 16]
        bound = np.abs(deq) + 64 * np.abs(d * sc).repeat(16, axis=1).reshape(n, k)
    return interleave_rows(QuantBlocks(int(qtype), torch.from_numpy(blocks), k)), deq, bound


def a8_type(kernels: cpu_kernels.CpuKernels, blocks: QuantBlocks) -> int:
    """The 8-bit activations' type code of ``blocks``; skips where this kind has no such tile (Q8_0
    without VNNI: its unsigned q would saturate maddubs)."""
    t = kernel_type(blocks) | A8
    if not kernels.quant_supported(t):
        assert blocks.type == Q.Q8_0 and kernels.kind in (CpuKind.AVX512, CpuKind.AVX2)
        pytest.skip("Q8_0 has no 8-bit tile without VNNI")
    return t


@pytest.mark.parametrize("k", [256, 2048])
def test_quantization_bounds_each_value_and_passes_twice_where_a_block_stands_out(
    kernels: cpu_kernels.CpuKernels, k: int
) -> None:
    x = activations(6, k, 7, torch.float32)
    x[2, 40] = 3000.0  # one channel far above the rest: its block takes the residual pass
    x[4] = 0.0
    blocks = quantized(kernels, x)
    xb = x.double().numpy().reshape(6, -1, 32)
    amax, asum = np.abs(xb).max(axis=-1), np.abs(xb).sum(axis=-1)
    d = blocks["d"].reshape(6, -1).astype(np.float64)
    assert np.array_equal(blocks["d"].reshape(6, -1), (amax.astype(np.float32) / np.float32(127)))
    two = (blocks["two"][..., None] >> np.arange(8)) & 1  # [rows, k / 256, 8]
    two = two.reshape(6, -1).astype(bool)
    ratio = amax * 32 / np.maximum(SPREAD * asum, 1e-300)
    clear = np.abs(ratio - 1) > 1e-4  # away from the criterion's edge, where float32 sums may tip it
    assert np.array_equal(two[clear], (ratio > 1)[clear])
    assert two[2, 40 // 32] and not two[4].any()
    r = blocks["r"].reshape(6, -1, 32)
    assert not r[~two].any() and r[two].any()
    err = np.abs(xb - values(blocks).reshape(6, -1, 32))
    step = np.where(two, d / 128, d)[..., None]
    assert (err <= step * (0.5 + 1e-3) + 1e-30).all()
    for field in ("q", "r"):  # Q6_K's offset terms: -32 times each 16 values' integer sum, exactly
        want = -32 * blocks[field].astype(np.int64).reshape(6, -1, 16).sum(axis=-1)
        assert np.array_equal(blocks[field + "off"].reshape(6, -1), want)
    sums = values(blocks).reshape(6, -1, 32).sum(axis=-1)
    atol = 1e-6 * np.abs(x.double().numpy()).max()
    assert np.allclose(blocks["s"].reshape(6, -1), sums, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("qtype", A8_TYPES, ids=[t.name for t in A8_TYPES])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 8, 13, 40, 150])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_tiles_match_float64(
    kernels: cpu_kernels.CpuKernels, qtype: Q, n: int, k: int, rows: int, dtype: torch.dtype
) -> None:
    """(a) Against float64 of the activations as the kernel quantized them: the integer dots exact,
    each (sub-block, row) term a float32 product and sum, at most 6 roundings per 32 values of the
    terms' magnitudes, then the output's rounding. (b) Against the unquantized activations: (a)
    plus what the rounding moved, |x - xq| |w|."""
    x8, deq, bound = held(qtype, n, k)
    x = activations(rows, k, rows * 5 + n, dtype)
    residual = torch.randn(rows, n).to(dtype) if rows % 2 else None
    y = kernels.quant_matmul(a8_type(kernels, x8), x8.data, k, x, residual)
    assert y.shape == (rows, n) and y.dtype == dtype
    got = y.double().numpy()
    xq = values(quantized(kernels, x))
    res64 = residual.double().numpy() if residual is not None else np.zeros((rows, n))
    ref_q = res64 + xq @ deq.T
    out_round = 2.0**-8 if dtype == torch.bfloat16 else EPS32
    tol_a = (6 * k / 32 + 16) * EPS32 * (np.abs(xq) @ bound.T) + out_round * np.abs(ref_q)
    tol_a += EPS32 * np.abs(res64) + 1e-30
    assert (np.abs(got - ref_q) <= tol_a).all(), f"tight: worst {np.max(np.abs(got - ref_q) / tol_a):.3g}"
    x64 = x.double().numpy()
    tol_b = np.abs(x64 - xq) @ np.abs(deq).T + tol_a
    assert (np.abs(got - (res64 + x64 @ deq.T)) <= tol_b).all()


@pytest.mark.parametrize("qtype", A8_TYPES, ids=[t.name for t in A8_TYPES])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(
    kernels: cpu_kernels.CpuKernels, qtype: Q
) -> None:
    """Rows whose blocks take the residual pass share tiles with rows whose blocks do not: each row's
    output is the bits it has alone, in any order, and whichever path its call takes (up to 8-16 rows
    the tile reads the blocks where they lie; 40 rows unpack them first)."""
    x8, _, _ = held(qtype, 24, 1024)
    x = activations(40, 1024, 3, torch.float32)
    x[5, 300] = 5000.0
    x[9] *= 1e-3
    t = a8_type(kernels, x8)
    together = kernels.quant_matmul(t, x8.data, 1024, x)
    assert torch.equal(kernels.quant_matmul(t, x8.data, 1024, x[:12]), together[:12])
    for i in range(12):
        assert torch.equal(kernels.quant_matmul(t, x8.data, 1024, x[i : i + 1]), together[i : i + 1])
    order = torch.tensor([9, 5, 0, 11, 3, 30])
    assert torch.equal(kernels.quant_matmul(t, x8.data, 1024, x[order]), together[order])


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=["Q4_K", "Q6_K"])
def test_slices_over_a_long_row_give_each_rows_bits_alone(kernels: cpu_kernels.CpuKernels, qtype: Q) -> None:
    """k of 10 blocks: two whole slices of 4 and a short one, each summed into the output in turn (on
    avx2 from 5 rows unpacked a slice at a time, csrc/quant_kx8.c's kx8_loop_u), a pair of groups and a
    lone one, rows with and without the residual pass: each row the bits it has alone (one row reads
    the blocks where they lie)."""
    x8, _, _ = held(qtype, 24, 2560)
    x = activations(9, 2560, 17, torch.float32)
    x[2, 700] = 5000.0
    x[6, 2000:2100] *= 40.0
    t = a8_type(kernels, x8)
    together = kernels.quant_matmul(t, x8.data, 2560, x)
    for i in range(9):
        assert torch.equal(kernels.quant_matmul(t, x8.data, 2560, x[i : i + 1]), together[i : i + 1])
    assert torch.equal(kernels.quant_matmul(t, x8.data, 2560, x[3:8]), together[3:8])


@pytest.mark.parametrize("qtype", A8_TYPES, ids=[t.name for t in A8_TYPES])
def test_every_kind_with_the_tiles_gives_the_same_bits(qtype: Q) -> None:
    """vpdpbusd (the VNNI builds) and maddubs + madd (AVX-512 without VNNI, AVX2) sum the same integers."""
    x8, _, _ = held(qtype, 40, 512)
    libs = [cpu_kernels.CpuKernels(cpu_kernels.build(kind), kind) for kind in kinds_with_tiles()]
    libs = [lib for lib in libs if lib.quant_supported(kernel_type(x8) | A8)]
    if len(libs) < 2:
        pytest.skip("fewer than two kinds with this type's 8-bit tiles here")
    x = activations(19, 512, 11, torch.bfloat16)
    outs = [lib.quant_matmul(kernel_type(x8) | A8, x8.data, 512, x) for lib in libs]
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


def test_quant_linear_takes_8_bits_from_the_tables_rows(kernels: cpu_kernels.CpuKernels) -> None:
    """Below A8_MIN_ROWS a Linear gives the 16-bit tile's bits, from it the 8-bit tile's, part by part
    (a Q4_K_M layer's q/k/v: Q4_K, Q4_K, Q6_K, whose thresholds may differ)."""
    parts = [held(qtype, 16, 512)[0] for qtype in (Q.Q4_K, Q.Q4_K, Q.Q6_K)]
    linear = QuantLinear(QuantizedWeight(tuple(parts)), None, kernels)
    at, at6 = A8_MIN_ROWS[kernels.kind][Q.Q4_K], A8_MIN_ROWS[kernels.kind][Q.Q6_K]
    assert linear.a8_min_rows == [at, at, at6]
    for rows in sorted({at - 1, at, at6 - 1, at6}):
        x = activations(rows, 512, rows, torch.bfloat16)
        outs = [
            kernels.quant_matmul(kernel_type(p) | (A8 if rows >= least else 0), p.data, 512, x)
            for p, least in zip(parts, linear.a8_min_rows, strict=True)
        ]
        want = torch.cat(outs, dim=1)
        assert torch.equal(linear(x), want)


def test_kinds_without_the_tiles_never_take_them() -> None:
    blocks = held(Q.Q4_K, 16, 256)[0]
    for kind in (CpuKind.PORTABLE,):
        lib = cpu_kernels.CpuKernels(cpu_kernels.build(kind), kind)
        assert not lib.quant_supported(kernel_type(blocks) | A8)
        assert a8_min_rows(lib, blocks) == NEVER
        assert lib.act8_block_bytes == ACT8.itemsize, "the test's view of act_block8 is csrc/quant.h's"


def test_legacy_rows_take_8_bits_only_where_k_is_whole_blocks_of_256(kernels: cpu_kernels.CpuKernels) -> None:
    """A Q4_0 Linear of k = 576 (SmolLM2's hidden size) keeps the 16-bit tile at any row count; one of
    k = 1536 takes the 8-bit one from the table's rows, whose bits it then gives. Q4_1 (the embedded
    model's type) never does."""
    x576, x1536 = (held(Q.Q4_0, 16, k)[0] for k in (576, 1536))
    assert a8_min_rows(kernels, x576) == NEVER
    at = a8_min_rows(kernels, x1536)
    assert at == A8_MIN_ROWS[kernels.kind][Q.Q4_0] < NEVER
    linear = QuantLinear(QuantizedWeight((x1536,)), None, kernels)
    x = activations(at, 1536, 5, torch.float32)
    assert torch.equal(linear(x), kernels.quant_matmul(kernel_type(x1536) | A8, x1536.data, 1536, x))
    assert not torch.equal(linear(x), kernels.quant_matmul(kernel_type(x1536), x1536.data, 1536, x))
    assert a8_min_rows(kernels, held(Q.Q4_1, 16, 1536)[0]) == NEVER
