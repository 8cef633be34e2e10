"""csrc/moe.c: a mixture of experts' block in one C call equals the same kernels called expert by
expert from Python (``QuantExperts.per_expert``), and the experts' dequantized weights in torch."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from bench.lib.gguf_models import random_blocks
from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.experts import QuantExperts, interleave_experts
from gpu_worker.backends.cpu.kind import requested_kind
from gpu_worker.backends.cpu.quant import NEVER
from gpu_worker.models.moe import ExpertGroups, Experts
from gpu_worker.weights.formats import QuantBlocks, QuantizedExperts

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

EXPERTS, HIDDEN, INNER, TOP_K = 6, 64, 32, 2


def stacked_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> QuantBlocks:
    w = (rng.standard_normal((EXPERTS * rows, cols)) * 0.3).astype(np.float32)
    return QuantBlocks(int(qtype), torch.from_numpy(gguf.quants.quantize(w, qtype)), cols)


def k_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> QuantBlocks:
    """Random K-quant blocks (gguf-py cannot quantize them) of sane scales."""
    return QuantBlocks(int(qtype), torch.from_numpy(random_blocks(qtype, EXPERTS * rows, cols, rng)), cols)


def groups_of(tokens: int, dtype: torch.dtype, seed: int) -> ExpertGroups:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen)
    return ExpertGroups.of(ids, (weights / weights.sum(-1, keepdim=True)).to(dtype), EXPERTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_one_call_equals_expert_by_expert(dtype: torch.dtype, tokens: int) -> None:
    """Same kernels, same order, same roundings: equal bit for bit, at one row, a few, and rows
    enough for the dense path on some experts; and close to torch on the dequantized weights."""
    kernels = cpu_kernels.load(requested_kind())
    if kernels is None:
        pytest.skip("the C kernels did not build")
    rng = np.random.default_rng(tokens)
    gate, up = stacked_blocks(rng, Q.Q8_0, INNER, HIDDEN), stacked_blocks(rng, Q.Q4_0, INNER, HIDDEN)
    down = stacked_blocks(rng, Q.Q4_1, HIDDEN, INNER)
    loaded = QuantizedExperts(gate, up, down, EXPERTS)
    reference = Experts(EXPERTS, HIDDEN, INNER, "silu")
    reference.gate_up_proj.data, reference.down_proj.data = loaded.dequantize()
    module = Experts(EXPERTS, HIDDEN, INNER, "silu")
    module.fused = kernels
    experts = QuantExperts(interleave_experts(loaded), kernels, module.act, module.act_mul)
    assert experts.one_call
    x = torch.from_numpy(rng.standard_normal((tokens, HIDDEN)).astype(np.float32)).to(dtype)
    groups = groups_of(tokens, dtype, seed=tokens)
    got = experts(x, groups)
    assert torch.equal(got, experts.per_expert(x, groups))
    want = reference(x.float(), groups_of(tokens, torch.float32, seed=tokens))
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05 * float(want.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_one_call_equals_expert_by_expert_on_k_quants(dtype: torch.dtype, tokens: int) -> None:
    """The same on Q4_K_M's expert types (gate and up Q4_K, down Q6_K, interleaved by 8), whose
    experts' panels the one region shares out over threads by rows: bit for bit, with the experts
    whose spans reach A8_MIN_ROWS on 8-bit activations where the build has them."""
    kernels = cpu_kernels.load(requested_kind())
    if kernels is None:
        pytest.skip("the C kernels did not build")
    hidden = inner = 256
    rng = np.random.default_rng(100 + tokens)
    gate, up = k_blocks(rng, Q.Q4_K, inner, hidden), k_blocks(rng, Q.Q4_K, inner, hidden)
    loaded = QuantizedExperts(gate, up, k_blocks(rng, Q.Q6_K, hidden, inner), EXPERTS)
    module = Experts(EXPERTS, hidden, inner, "silu")
    module.fused = kernels
    experts = QuantExperts(interleave_experts(loaded), kernels, module.act, module.act_mul)
    x = torch.from_numpy(rng.standard_normal((tokens, hidden)).astype(np.float32)).to(dtype)
    groups = groups_of(tokens, dtype, seed=tokens)
    if tokens == 40 and experts.gate_up[0].a8_min_rows[0] < NEVER:  # some experts on 8-bit activations
        assert int(groups.spans[:, 2].max()) >= experts.gate_up[0].a8_min_rows[0]
    got = experts(x, groups)
    assert torch.equal(got, experts.per_expert(x, groups))
    reference = Experts(EXPERTS, hidden, inner, "silu")
    reference.gate_up_proj.data, reference.down_proj.data = loaded.dequantize()
    want = reference(x.float(), groups_of(tokens, torch.float32, seed=tokens))
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05 * float(want.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "norm_topk"), [(1, True), (7, False), (40, True)])
@pytest.mark.parametrize("experts", [32, 30])  # 30: the AVX-512 router's last group of 4 holds 2
def test_the_c_router_picks_torchs_experts_with_its_weights(
    dtype: torch.dtype, tokens: int, norm_topk: bool, experts: int
) -> None:
    """csrc/moe.c's moe_route against the torch route of models/moe.py (softmax in float32, top-k,
    renormalised where norm_topk): the same experts in the same order, weights within float32's
    rounding (then the dtype's)."""
    kernels = cpu_kernels.load(requested_kind())
    if kernels is None:
        pytest.skip("the C kernels did not build")
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 256, generator=gen).to(dtype)
    weight = (torch.randn(experts, 256, generator=gen) * 0.2).to(dtype)
    ids, weights = kernels.moe_route(x, weight, 4, norm_topk)
    probs = torch.softmax(x.double() @ weight.double().T, dim=-1)
    top, want_ids = torch.topk(probs, 4, dim=-1)
    if norm_topk:
        top = top / top.sum(dim=-1, keepdim=True)
    assert torch.equal(ids, want_ids)
    assert weights.dtype == dtype
    torch.testing.assert_close(
        weights.double(), top.to(dtype).double(), rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_the_c_grouping_is_expert_groups_of(dtype: torch.dtype, tokens: int) -> None:
    """csrc/moe.c's moe_group (QuantExperts.group) gives ExpertGroups.of's pairs in its order: the
    same rows, weights and spans, experts that no row chose left out; an expert id past the last
    is refused, not written."""
    kernels = cpu_kernels.load(requested_kind())
    if kernels is None:
        pytest.skip("the C kernels did not build")
    num_experts, top_k = 64, 6
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen).to(dtype)
    rng = np.random.default_rng(tokens)
    gate, up = (stacked_blocks(rng, Q.Q8_0, INNER, HIDDEN) for _ in range(2))
    loaded = QuantizedExperts(gate, up, stacked_blocks(rng, Q.Q8_0, HIDDEN, INNER), EXPERTS)
    experts = QuantExperts(loaded, kernels, torch.nn.functional.silu, lambda t: t)
    got, want = experts.group(ids, weights, num_experts), ExpertGroups.of(ids, weights, num_experts)
    assert got.num_tokens == want.num_tokens == tokens
    for name in ("tokens", "weights", "spans"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    past = ids.clone()
    past[-1, -1] = num_experts
    with pytest.raises(RuntimeError, match="RV_ERR_EXPERT_SIZE"):
        kernels.moe_group(past, weights, num_experts)
