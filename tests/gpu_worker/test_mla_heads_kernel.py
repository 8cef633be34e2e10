"""Latent attention's per-head products on a GGUF's blocks (csrc/mla.c's latent_heads_matmul, through
backends/cpu/latent_heads.py) against float64 on the blocks' own values: DeepSeek-V2-Lite's attn_k_b
(Q5_0, [16 x 512, 128]) and attn_v_b (Q4_K, [16 x 128, 512]) shapes and a Q8_0 one, heads read from
strided rows as the model hands them (q's nope part, the latent kernel's wider output), one and
several rows, float32 and bfloat16."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.latent_heads import LatentHeads
from gpu_worker.weights.formats import QuantBlocks
from tests.gpu_worker.test_cpu_kernels import needs_compiler
from tests.gpu_worker.test_quant_k_kernels import random_blocks

Q = gguf.GGMLQuantizationType
HEADS = 16


def _blocks(rows: int, cols: int, qtype: Q, seed: int) -> tuple[QuantBlocks, torch.Tensor]:
    """Random blocks [rows, cols] of ``qtype`` (gguf quantizes the legacy types; a K-quant's bytes are
    random) and their values in float64."""
    if qtype == Q.Q4_K:
        data = random_blocks(qtype, rows, cols, seed)
    else:
        values = np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32)
        data = gguf.quants.quantize(values, qtype)
    block = QuantBlocks(int(qtype), torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)), cols)
    return block, torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qtype))).double()


@needs_compiler
@pytest.mark.cpu_kinds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize(
    ("k_type", "v_type"), [(Q.Q5_0, Q.Q4_K), (Q.Q8_0, Q.Q8_0)], ids=["q5_0-q4_k", "q8_0"]
)
def test_heads_against_float64(
    kernels: cpu_kernels.CpuKernels, dtype: torch.dtype, rows: int, k_type: Q, v_type: Q
) -> None:
    rank, nope, v_dim = 512, 128, 128
    k_b, k_w = _blocks(HEADS * rank, nope, k_type, seed=1)
    v_b, v_w = _blocks(HEADS * v_dim, rank, v_type, seed=2)
    heads = LatentHeads(k_b, v_b, HEADS, kernels)
    torch.manual_seed(rows)
    q = torch.randn(rows, HEADS, nope + 64).to(dtype)  # q's nope part: a strided view, as project gives it
    q_lat = heads.absorb_query(q[..., :nope])
    want = torch.einsum("thn,hrn->thr", q[..., :nope].double(), k_w.view(HEADS, rank, nope))
    tolerance = 1e-3 if dtype == torch.float32 else 2e-2  # 16-bit activation blocks; bf16's rounding
    assert q_lat.shape == (rows, HEADS, rank) and q_lat.dtype == dtype
    assert (q_lat.double() - want).abs().max() <= tolerance * want.abs().max()
    attended = torch.randn(rows, HEADS, rank + 64).to(dtype)  # the latent kernel's output, rope part past r
    out = heads.values(attended[..., :rank])
    want = torch.einsum("thr,hvr->thv", attended[..., :rank].double(), v_w.view(HEADS, v_dim, rank))
    assert out.shape == (rows, HEADS, v_dim)
    assert (out.double() - want).abs().max() <= tolerance * want.abs().max()
