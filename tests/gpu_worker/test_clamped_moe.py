"""csrc/moe.c's moe_experts_clamped: gpt-oss's experts (biases, the clamped SwiGLU) on MXFP4 blocks in
one C call equal the same kernels called expert by expert from Python (``ClampedQuantExperts.
per_expert``, its glu in torch), and the module's torch experts on the dequantized weights."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.clamped_experts import ClampedQuantExperts
from gpu_worker.backends.cpu.kind import requested_kind
from gpu_worker.models.gpt_oss import ClampedSwigluExperts
from gpu_worker.models.moe import ExpertGroups
from gpu_worker.weights.formats import QuantBlocks, QuantizedExperts

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

EXPERTS, HIDDEN, INNER, TOP_K = 5, 96, 64, 2
ALPHA, LIMIT = 1.702, 7.0


def stacked_mxfp4(rng: np.random.Generator, rows: int, cols: int) -> QuantBlocks:
    # large enough that gu reaches past the limit on some entries: the clamps are exercised
    w = (rng.standard_normal((EXPERTS * rows, cols)) * 0.6).astype(np.float32)
    return QuantBlocks(int(Q.MXFP4), torch.from_numpy(gguf.quants.quantize(w, Q.MXFP4)), cols)


def modules(rng: np.random.Generator) -> tuple[ClampedSwigluExperts, ClampedSwigluExperts]:
    """The experts on blocks, and their twin holding the same weights dequantized."""
    gate, up = stacked_mxfp4(rng, INNER, HIDDEN), stacked_mxfp4(rng, INNER, HIDDEN)
    loaded = QuantizedExperts(gate, up, stacked_mxfp4(rng, HIDDEN, INNER), EXPERTS)
    on_blocks, twin = (ClampedSwigluExperts(EXPERTS, HIDDEN, INNER, ALPHA, LIMIT) for _ in range(2))
    gate_up, down = loaded.dequantize()  # gate rows then up rows: the twin holds them interleaved
    interleaved = torch.stack((gate_up[:, :INNER], gate_up[:, INNER:]), dim=2)
    twin.gate_up_proj.data, twin.down_proj.data = interleaved.reshape(gate_up.shape), down
    normal = rng.standard_normal((EXPERTS, 2 * INNER + HIDDEN), dtype=np.float32)
    twin.gate_up_proj_bias.data = torch.from_numpy(normal[:, : 2 * INNER].copy())
    twin.down_proj_bias.data = torch.from_numpy(normal[:, 2 * INNER :].copy())
    on_blocks.gate_up_proj_bias.data = twin.gate_up_proj_bias.data.clone()
    on_blocks.down_proj_bias.data = twin.down_proj_bias.data.clone()
    on_blocks.quantized = loaded
    return on_blocks, twin


def groups_of(tokens: int, dtype: torch.dtype, seed: int) -> ExpertGroups:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen)
    return ExpertGroups.of(ids, (weights / weights.sum(-1, keepdim=True)).to(dtype), EXPERTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 4, 40])
def test_clamped_one_call_equals_expert_by_expert(dtype: torch.dtype, tokens: int) -> None:
    """The same kernels, biases and roundings: equal to the expert-by-expert path but for the
    sigmoid's last bits (its exp is not torch's), at one row, a few, and rows enough for the dense
    path; and close to torch's clamped experts on the dequantized weights."""
    kernels = cpu_kernels.load(requested_kind())
    if kernels is None:
        pytest.skip("the C kernels did not build")
    rng = np.random.default_rng(tokens)
    module, twin = modules(rng)
    experts = ClampedQuantExperts(module, kernels, dtype)
    x = torch.from_numpy(rng.standard_normal((tokens, HIDDEN)).astype(np.float32)).to(dtype)
    groups = groups_of(tokens, dtype, seed=tokens)
    got = experts(x, groups)
    per_expert = experts.per_expert(x, groups)
    gu = torch.cat([experts.blocks.gate_up[e](x) for e in range(EXPERTS)])
    assert float(gu.abs().max()) > LIMIT, "no entry reaches the clamp"
    if dtype == torch.float32:
        torch.testing.assert_close(got, per_expert, rtol=1e-5, atol=1e-5)
    else:  # a sigmoid one ulp apart may round to the neighbouring bfloat16
        torch.testing.assert_close(got.float(), per_expert.float(), rtol=0.02, atol=0.02)
    want = twin(x.double().float(), groups_of(tokens, torch.float32, seed=tokens))
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05 * float(want.abs().max()))
