"""Latent attention's per-head kv_b products on a GGUF's blocks (csrc/mla.c's latent_heads_matmul).

The absorbed decode (models/mla.py) multiplies each head's query by its key half of kv_b and each
head's attended latent by its value half: two batched products a layer over [H, 512, 128] weights.
As float32 they are a decode step's largest reads after the experts' (8 MB a layer for
DeepSeek-V2-Lite, against 1.3 MB of the file's Q5_0 / Q4_K blocks), so where the file holds them as
blocks the kernels read those, every head in one call: ``attn_k_b`` (rows: each head's latent
dimensions, columns its nope dimensions) and ``attn_v_b`` (rows: its value dimensions, columns the
latent's), as gguf_mla.py keeps them.

``attach`` also gives a DeepSeek-V2 router (a softmax top-k alone) csrc/moe.c's one-call router.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import nn

from gpu_worker.backends.cpu import abi
from gpu_worker.backends.cpu.build import DTYPE_CODES
from gpu_worker.backends.cpu.experts import QuantExperts, QuantRouter
from gpu_worker.backends.cpu.kernels import CpuKernels
from gpu_worker.models.deepseek_moe import DeepseekMoe
from gpu_worker.models.mla import LatentProjection
from gpu_worker.weights.formats import QuantBlocks


class HeadsMatmul:
    """The binding of ``latent_heads_matmul`` in a built kernels library."""

    def __init__(self, path: Path) -> None:
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        self._matmul = ctypes.CDLL(str(path)).latent_heads_matmul
        self._matmul.argtypes = [i32, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, ptr, i64, i64, i32]
        self._matmul.restype = i32
        abi.check(abi.bound_functions(self), {}, {})

    def __call__(self, w: QuantBlocks, act_bytes: int, x: torch.Tensor, out_cols: int) -> torch.Tensor:
        """x [T, H, k] (each head's rows with their last dim contiguous) -> [T, H, n]: head h's rows
        through the blocks' rows [h n, (h + 1) n)."""
        rows, heads, k = x.shape
        assert x.stride(2) == 1 and x.dtype in DTYPE_CODES and k == w.cols
        out = torch.empty((rows, heads, out_cols), dtype=x.dtype)
        scratch = torch.empty(max(heads * rows * act_bytes, 1), dtype=torch.uint8)
        status = self._matmul(
            w.type, w.data.data_ptr(), heads, out_cols, k, x.data_ptr(), x.stride(0), x.stride(1), rows,
            scratch.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1), DTYPE_CODES[x.dtype],
        )  # fmt: skip
        assert status == 0, f"latent_heads_matmul refused ({abi.status_text(status)}): type {w.type}, k={k}"
        return out


@functools.cache
def load(path: Path) -> HeadsMatmul:
    return HeadsMatmul(path)


class LatentHeads:
    """One layer's ``absorb_query`` and ``values`` (models/mla.py's LatentProjection) on its blocks,
    for batches of up to ``max_rows`` tokens: past that (32 decode rows) the products cost compute
    more than reads, and the float32 bmm's is the cheaper."""

    max_rows = 16

    def __init__(self, k_b: QuantBlocks, v_b: QuantBlocks, heads: int, kernels: CpuKernels) -> None:
        self.k_b, self.v_b, self.heads = k_b, v_b, heads
        self.rank, self.v_dim = k_b.rows // heads, v_b.rows // heads
        self.k_act = kernels.quant_check(k_b.type, k_b.data, k_b.cols)
        self.v_act = kernels.quant_check(v_b.type, v_b.data, v_b.cols)
        self.matmul = load(kernels.path)

    def tensors(self) -> list[torch.Tensor]:
        return [self.k_b.data, self.v_b.data]

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, nope] -> [T, H, r]."""
        return self.matmul(self.k_b, self.k_act, q_nope, self.rank)

    def values(self, attended: torch.Tensor) -> torch.Tensor:
        """attended [T, H, r] -> [T, H, v]."""
        return self.matmul(self.v_b, self.v_act, attended, self.v_dim)


def attach(model: nn.Module, kernels: CpuKernels, dtype: torch.dtype) -> None:
    """``LatentHeads`` in each latent projection the loader gave its file's blocks; csrc/moe.c's
    router in each DeepSeek router of experts on blocks that is a plain softmax top-k (as
    prepare.py routes Qwen3-MoE's and Mixtral's), a call where torch takes five."""
    for module in model.modules():
        if isinstance(module, LatentProjection) and module.quantized is not None:
            k_b, v_b = module.quantized
            module.attach(heads=LatentHeads(k_b, v_b, module.num_heads, kernels))
        elif isinstance(module, DeepseekMoe) and isinstance(module.experts.impl, QuantExperts):
            router = module.gate
            if router.plain_softmax:
                weight = router.weight.detach().to(dtype)
                router.attach(route=QuantRouter(weight, router.args.top_k, False, kernels))
