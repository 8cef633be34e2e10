"""MXFP4 held interleaved by 8 (csrc/quant_mxfp4.c) on 8-bit activations (act8_32: per 32 values,
so gpt-oss's k = 2880 takes them): the tile against float64 products over gguf-py's dequantization,
on every CPU kind this machine runs; the same bits on every kind, the portable reference among them;
a row's output whatever rows are beside it; QuantLinear taking them from A8_MIN_ROWS rows; and
moe.c's experts taking them for an expert with that many rows, equal to quant_matmul's expert by
expert."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.experts import QuantExperts, interleave_experts
from gpu_worker.backends.cpu.kind import CpuKind
from gpu_worker.backends.cpu.layouts import A8, kernel_type
from gpu_worker.backends.cpu.quant import A8_MIN_ROWS, NEVER, QuantLinear, a8_min_rows
from gpu_worker.models.moe import ExpertGroups, Experts
from gpu_worker.weights.formats import QuantBlocks, QuantizedExperts, QuantizedWeight
from tests.gpu_worker.a8_checks import check_a8_unquantized, check_rows_alone
from tests.gpu_worker.helpers import KINDS
from tests.gpu_worker.quant_reference import activations
from tests.gpu_worker.test_mxfp4_x8 import held

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

# (n, k, rows): one group; two (one 16-row tile); a pair and a lone group at k past a 32-block chunk;
# a gpt-oss-wide row (k = 2880, 90 blocks) over five groups. Rows: one, several groups of up to 8
CASES = [(8, 32, 1), (8, 32, 6), (16, 96, 3), (16, 96, 13), (24, 640, 8), (24, 640, 33), (40, 2880, 9)]


@pytest.mark.parametrize(("n", "k", "rows"), CASES, ids=[f"{n}x{k}-{rows}" for n, k, rows in CASES])
def test_8_bit_tile_matches_float64(kernels: cpu_kernels.CpuKernels, n: int, k: int, rows: int) -> None:
    """Against the unquantized activations: what the 8-bit rounding moved (a8_step per value times
    |w|), plus float32 roundings of the block terms, plus the output's."""
    x8, deq = held(n, k)
    x = activations(rows, k, torch.float32, rows * 5 + n)
    x[0, 7] = 400.0  # a block far above the rest: the residual pass
    residual = torch.randn(rows, n) if rows % 2 else None
    assert kernels.quant_supported(kernel_type(x8) | A8)
    y = kernels.quant_matmul(kernel_type(x8) | A8, x8.data, k, x, residual)
    check_a8_unquantized(y, x, residual, deq, np.abs(deq))


def test_a_rows_output_does_not_depend_on_the_rows_beside_it(kernels: cpu_kernels.CpuKernels) -> None:
    check_rows_alone(kernels, held(40, 640)[0], 640)


@pytest.mark.skipif(len(KINDS) < 2, reason="this CPU runs one kind: nothing to compare")
@pytest.mark.parametrize("rows", [2, 7, 19])
def test_every_kind_gives_the_same_bits(rows: int) -> None:
    """The AVX-512 tiles take 16 weight rows a pass (vpdpbusd, or maddubs without VNNI), AVX2 8, the
    portable reference one: the same integers and float steps per output, so the same bits."""
    x8, _ = held(40, 640)
    x = activations(rows, 640, torch.bfloat16, rows + 11)
    x[0, 30] = 300.0
    libs = [cpu_kernels.CpuKernels(cpu_kernels.build(kind), kind) for kind in KINDS]
    outs = [lib.quant_matmul(kernel_type(x8) | A8, x8.data, 640, x) for lib in libs]
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


def test_quant_linear_takes_8_bits_from_the_tables_rows(kernels: cpu_kernels.CpuKernels) -> None:
    """gpt-oss's k: 16-bit activations below MXFP4's A8_MIN_ROWS, 8-bit from it; never on portable."""
    x8, _ = held(16, 2880)
    linear = QuantLinear(QuantizedWeight((x8,)), None, kernels)
    want = A8_MIN_ROWS[kernels.kind].get(Q.MXFP4, NEVER)
    assert linear.a8_min_rows == [want] == [a8_min_rows(kernels, x8)]
    if kernels.kind == CpuKind.PORTABLE:
        assert want == NEVER
        return
    for rows in (want - 1, want):
        x = activations(rows, 2880, torch.bfloat16, rows)
        t = kernel_type(x8) | (A8 if rows >= want else 0)
        assert torch.equal(linear(x), kernels.quant_matmul(t, x8.data, 2880, x))


@pytest.mark.parametrize("tokens", [3, 40])
def test_experts_take_8_bits_from_the_tables_rows(kernels: cpu_kernels.CpuKernels, tokens: int) -> None:
    """moe.c's one call on MXFP4 experts at widths not whole 256s: the experts whose rows reach
    MXFP4's A8_MIN_ROWS on 8-bit activations, the others on 16, equal to the same kernels called
    expert by expert (QuantLinear's thresholds) but for the silu's last bits."""
    experts_n, hidden, inner = 4, 96, 160
    rng = np.random.default_rng(tokens)
    parts = [
        QuantBlocks(int(Q.MXFP4), torch.from_numpy(gguf.quants.quantize(w, Q.MXFP4)), w.shape[1])
        for w in (
            (rng.standard_normal((experts_n * rows, cols)) * 0.3).astype(np.float32)
            for rows, cols in ((inner, hidden), (inner, hidden), (hidden, inner))
        )
    ]
    module = Experts(experts_n, hidden, inner, "silu")
    experts = QuantExperts(
        interleave_experts(QuantizedExperts(parts[0], parts[1], parts[2], experts_n)),
        kernels,
        module.act,
        module.act_mul,
    )
    want = A8_MIN_ROWS[kernels.kind].get(Q.MXFP4, NEVER)
    assert experts.gate_up[0].a8_min_rows == [want, want] and experts.down[0].a8_min_rows == [want]
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts_n, generator=gen)[:2] for _ in range(tokens)])
    groups = ExpertGroups.of(ids, torch.rand(tokens, 2, generator=gen), experts_n)
    if tokens == 40 and want < NEVER:  # some experts on 8-bit activations
        assert int(groups.spans[:, 2].max()) >= want
    x = activations(tokens, hidden, torch.float32, tokens)
    # the one call's silu is C's, an ulp from torch's at places: far below 8 bits' change (~1e-3)
    torch.testing.assert_close(experts(x, groups), experts.per_expert(x, groups), rtol=1e-5, atol=1e-3)
