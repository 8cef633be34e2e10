"""CpuLinear: every path of every kind this CPU runs gives x W^T + b within one bf16 rounding, and the
path per row count is the committed plan's."""

from __future__ import annotations

import pytest
import torch

from bench.matmul_paths import plan_of
from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.kind import CpuKind, requested_kind
from gpu_worker.backends.cpu.matmul import PLANS, CpuLinear, MatmulPlan, can_pack
from tests.gpu_worker.helpers import KINDS


def test_every_kind_has_a_plan() -> None:
    assert set(PLANS) == set(CpuKind)
    with pytest.raises(AssertionError, match="overlap"):
        MatmulPlan(c_max_rows=8, fp32_min_rows=8)


@pytest.mark.parametrize("kind", KINDS, ids=[k.value for k in KINDS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_paths_across_the_plans_boundaries(kind: CpuKind, with_bias: bool) -> None:
    kernels = cpu_kernels.CpuKernels(cpu_kernels.build(kind), kind)
    torch.manual_seed(0)
    weight, bias = torch.randn(40, 72).bfloat16(), torch.randn(40).bfloat16()
    linear = CpuLinear(weight, bias if with_bias else None, kind, kernels)
    plan = PLANS[kind]
    assert linear.c_max_rows == plan.c_max_rows
    assert linear.paths["c"] == (plan.c_max_rows > 0)
    assert linear.paths["onednn"] == (
        can_pack(torch.bfloat16, kind) and plan.fp32_min_rows != plan.c_max_rows + 1
    )
    assert not (linear.paths["onednn"] and not kind.includes(CpuKind.AVX512)), "no bf16 reorder below AVX-512"
    edges = {1, plan.c_max_rows, plan.c_max_rows + 1, plan.fp32_min_rows or 1, 33}
    for rows in sorted(r for r in edges if r >= 1):
        x, residual = torch.randn(rows, 72).bfloat16(), torch.randn(rows, 40).bfloat16()
        exact = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
        torch.testing.assert_close(linear(x).double(), exact, rtol=2**-7, atol=0.05)
        torch.testing.assert_close(
            linear.add_to(residual, x).double(), exact + residual.double(), rtol=2**-7, atol=0.1
        )
    assert linear(torch.empty(0, 72).bfloat16()).shape == (0, 40)


def test_float32_takes_onednn_or_torch_never_the_bf16_kernel() -> None:
    kind = requested_kind()
    weight = torch.randn(24, 16)
    linear = CpuLinear(weight, None, kind, cpu_kernels.load(kind))
    assert not linear.paths["c"] and not linear.paths["onednn_fp32"]
    x = torch.randn(3, 16)
    torch.testing.assert_close(linear(x), x @ weight.T, rtol=1e-5, atol=1e-5)


def test_bench_plan_takes_c_while_fastest_and_fp32_from_where_it_stays_fastest() -> None:
    best = {
        1: {"c": 1.0, "onednn_fp32": 2.0},
        8: {"c": 3.0, "onednn_fp32": 3.5},
        16: {"c": 5.0, "onednn_fp32": 4.0},
        32: {"c": 9.0, "onednn_fp32": 6.0},
    }
    assert plan_of(best) == (8, 16)
    best[16]["c"] = 3.9  # fp32 loses at 16: it only starts at 32
    assert plan_of(best) == (16, 32)


@pytest.mark.parametrize("kind", KINDS, ids=[k.value for k in KINDS])
def test_bf16_without_c_kernels_never_falls_to_torch_bf16(kind: CpuKind) -> None:
    """--disable-cpu-kernels: where oneDNN has no bf16 (below AVX-512), fp32 takes every row count."""
    weight = torch.randn(24, 16).bfloat16()
    linear = CpuLinear(weight, None, kind, None)
    assert not linear.paths["c"] and not linear.paths["torch"]
    assert linear.paths["onednn_fp32"] or kind.includes(CpuKind.AVX512_BF16)
    x = torch.randn(2, 16).bfloat16()
    torch.testing.assert_close(linear(x).double(), x.double() @ weight.double().T, rtol=2**-7, atol=0.05)
