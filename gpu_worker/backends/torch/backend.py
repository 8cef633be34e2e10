"""The torch reference backend: torch's own ops on any device and dtype (float64 included).

It is the float64 reference of the exact tests and the path of any device no other backend
takes; it prepares nothing but tensor parallel's shard, so a model runs exactly as its modules are
written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from gpu_worker import tensor_parallel
from gpu_worker.backends.base import ALL_REDUCE
from gpu_worker.backends.memory import kv_pool_ceiling, kv_pool_tokens
from gpu_worker.backends.torch import attention

if TYPE_CHECKING:
    from torch import nn

    from gpu_worker.config import WorkerConfig
    from gpu_worker.forward_context import AttentionOptions, ForwardContext
    from gpu_worker.kv_cache import KVPool
    from gpu_worker.tensor_parallel import TensorParallel


def gloo_all_reduce(t: torch.Tensor) -> None:
    import torch.distributed as dist

    dist.all_reduce(t)


class TorchBackend:
    """torch's SDPA over K/V gathered through the page table (backends/torch/attention.py)."""

    name = "torch"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host_memory = device.type == "cpu"

    def auto_dtype(self, gguf_blocks: bool) -> str:
        return "float32" if self.host_memory else "bfloat16"

    def tower_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The activations': torch gathers a row's KV per read, so a 16-bit pool costs a widening
        copy per layer (--kv-cache-dtype still sets one, for tests and memory)."""
        return dtype

    def quantized_types(self) -> frozenset[int]:
        return frozenset()

    def kv_pool_tokens(self, configured: int, mem_fraction: float, bytes_per_token: int) -> int:
        return kv_pool_tokens(configured, mem_fraction, bytes_per_token, self.device)

    def kv_pool_ceiling(self, configured: int) -> int | None:
        return kv_pool_ceiling(configured, self.device)

    def prepare_model(self, model: nn.Module, dtype: torch.dtype, tp: TensorParallel | None) -> None:
        tensor_parallel.prepare_rank(model, tp, lambda: None)

    def init_forward_metadata(
        self, kv: KVPool, req_pool_idx: list[int], prefix_lens: list[int], extend_lens: list[int]
    ) -> tuple[torch.Tensor, Any]:
        return attention.build_metadata(
            kv.page_table, kv.page_size, req_pool_idx, prefix_lens, extend_lens, self.device
        )

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        options: AttentionOptions,
    ) -> torch.Tensor:
        blocks = ctx.images.blocks if ctx.images is not None else None
        return attention.attend(
            ctx.attn, q, k, v, ctx.k_cache[layer], ctx.v_cache[layer], options, blocks=blocks
        )

    def forward_decode(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        return None

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.max(dim=-1).indices

    def all_reduce(self, config: WorkerConfig) -> ALL_REDUCE:
        return gloo_all_reduce

    def before_batch(self, rows: int, tokens: int) -> None:
        return None

    def after_batch(self, seconds: float) -> None:
        return None
