"""The fused decode step of a Gated DeltaNet layer (csrc/gated_delta.c's ``gated_delta_decode_step``,
the ``decode_step`` slot) on every CPU kind this CPU runs: a layer's outputs and both of its pools
after decode steps equal the same layer's torch path in float64, in both key-head layouts, with
rows at scattered slots, and the slots it does not own untouched."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from gpu_worker.backends.cpu import gated_delta
from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.forward_context import ForwardContext
from gpu_worker.models.gated_delta import GatedDeltaNet
from gpu_worker.recurrent_state import RecurrentBatch, StatePool

pytestmark = pytest.mark.cpu_kinds

HIDDEN = 48
SLOTS = [3, 0, 5]  # the rows' slots, out of order; slots 1, 2, 4 and 6 belong to no row


@pytest.fixture(scope="module")
def gd(kernels: cpu_kernels.CpuKernels) -> gated_delta.GatedDeltaKernels:
    return gated_delta.load(kernels.path)


def _layer(tiled: bool, dtype: torch.dtype) -> GatedDeltaNet:
    cfg = SimpleNamespace(
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=32, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, hidden_size=HIDDEN, rms_norm_eps=1e-6,
    )  # fmt: skip
    layer = GatedDeltaNet(cfg, 0, "split", tiled_values=tiled)
    gen = torch.Generator().manual_seed(7)
    for name, p in layer.named_parameters():
        scale = {"A_log": 0.5, "dt_bias": 1.0, "norm.weight": 0.2}.get(name, 0.3)
        p.data = (torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
        if name == "norm.weight":
            p.data += 1.0
    return layer


def _pool(layer: GatedDeltaNet, dtype: torch.dtype) -> StatePool:
    pool = StatePool(layer.state_shape(1), 7, 0, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(11)
    pool.conv[0].copy_(torch.randn(pool.conv[0].shape, generator=gen, dtype=torch.float64))
    pool.recurrent[0].copy_(torch.randn(pool.recurrent[0].shape, generator=gen, dtype=torch.float64) * 0.1)
    return pool


def _steps(layer: GatedDeltaNet, pool: StatePool, xs: list[torch.Tensor]) -> torch.Tensor:
    outs = []
    for x in xs:
        batch = RecurrentBatch.of(pool, SLOTS, [1] * len(SLOTS))
        outs.append(layer(x.to(pool.conv[0].dtype), cast(ForwardContext, SimpleNamespace(recurrent=batch))))
    return torch.stack(outs)


@pytest.mark.parametrize("tiled", [False, True])
def test_decode_step_is_the_torch_layer(gd: gated_delta.GatedDeltaKernels, tiled: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(len(SLOTS), HIDDEN, generator=gen, dtype=torch.float64) for _ in range(3)]
    want_layer = _layer(tiled, torch.float64)
    want_pool = _pool(want_layer, torch.float64)
    want = _steps(want_layer, want_pool, xs)
    layer = _layer(tiled, torch.float32)
    layer.attach(decode_step=gd)
    pool = _pool(layer, torch.float32)
    before = [t.clone() for t in (pool.conv[0], pool.recurrent[0])]
    calls: list[Any] = []
    step = gd.decode_step

    def counted(*args: Any) -> torch.Tensor:
        calls.append(args)
        return step(*args)

    object.__setattr__(gd, "decode_step", counted)
    try:
        got = _steps(layer, pool, xs)
    finally:
        object.__delattr__(gd, "decode_step")
    assert len(calls) == len(xs), "the fused step did not run"
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool.conv[0].double(), want_pool.conv[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        pool.recurrent[0].double(), want_pool.recurrent[0].double(), rtol=1e-4, atol=1e-5
    )
    idle = [1, 2, 4, 6]
    for now, was in zip((pool.conv[0], pool.recurrent[0]), before, strict=True):
        assert torch.equal(now[idle], was[idle]), "a slot no row owns changed"


def test_decode_step_refuses_a_slot_outside_the_pool(gd: gated_delta.GatedDeltaKernels) -> None:
    layer = _layer(False, torch.float32)
    layer.attach(decode_step=gd)
    pool = _pool(layer, torch.float32)
    batch = RecurrentBatch.of(pool, [0, 7], [1, 1])
    x = torch.randn(2, HIDDEN)
    with pytest.raises(AssertionError, match="gated_delta_decode_step refused"):
        layer(x, cast(ForwardContext, SimpleNamespace(recurrent=batch)))


class _GatheredRoute:
    """The kernels as a backend without tiled heads sees them: q and k repeated onto the value heads."""

    tiled_heads = False

    def __init__(self, gd: gated_delta.GatedDeltaKernels) -> None:
        self.decode, self.prefill, self.conv1d = gd.decode, gd.prefill, gd.conv1d


def _prefill(layer: GatedDeltaNet, pool: StatePool, x: torch.Tensor, saves: dict[int, tuple[int, int]],
             gather: bool) -> torch.Tensor:  # fmt: skip
    batch = RecurrentBatch.of(pool, SLOTS, PREFILL_LENS, saves)
    if gather:  # every round through index_select / index_copy, as a round of a batch's part is
        batch.__dict__["rounds"] = [dataclasses.replace(r, whole=False) for r in batch.rounds]
    else:
        assert [r.whole for r in batch.rounds] == ([False, False] if saves else [True])
    return layer(x.to(pool.conv[0].dtype), cast(ForwardContext, SimpleNamespace(recurrent=batch)))


PREFILL_LENS = [5, 1, 70]  # a row past the kernels' 64-token block, and a one-token row among them


@pytest.mark.parametrize("saves", [{}, {2: (3, 6)}], ids=["whole", "checkpoint"])
@pytest.mark.parametrize("tiled", [False, True])
def test_pooled_prefill_reads_the_rows_where_they_lie(
    gd: gated_delta.GatedDeltaKernels, tiled: bool, saves: dict[int, tuple[int, int]]
) -> None:
    """A chunk's rows through the pooled kernels in place (one round, every token in order; tiled key
    heads by the kernels' flag) give the bits of the gathered route with q and k repeated, and the
    float64 torch layer's values; a checkpoint inside a row keeps its two gathered rounds."""
    x = torch.randn(
        sum(PREFILL_LENS), HIDDEN, generator=torch.Generator().manual_seed(5), dtype=torch.float64
    )
    want_layer = _layer(tiled, torch.float64)
    want_pool = _pool(want_layer, torch.float64)
    want = _prefill(want_layer, want_pool, x, saves, gather=False)
    got = {}
    for gather in (False, True):
        layer = _layer(tiled, torch.float32)
        kernels = _GatheredRoute(gd) if gather else gd
        layer.attach(pooled_rule=kernels, pooled_conv=kernels)
        pool = _pool(layer, torch.float32)
        got[gather] = (_prefill(layer, pool, x, saves, gather), pool.conv[0], pool.recurrent[0])
    for a, b in zip(got[False], got[True], strict=True):
        assert torch.equal(a, b), "the rows in place differ from the gathered route"
    out, conv, recurrent = got[False]
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=5e-5)  # float32 over 70 tokens
    torch.testing.assert_close(conv.double(), want_pool.conv[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(recurrent.double(), want_pool.recurrent[0].double(), rtol=1e-4, atol=1e-5)
