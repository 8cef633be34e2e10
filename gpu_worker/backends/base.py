"""The interface every device backend implements (gpu_worker/backends/__init__.py picks one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from torch import nn

    from gpu_worker.config import WorkerConfig
    from gpu_worker.forward_context import AttentionOptions, ForwardContext
    from gpu_worker.kv_cache import KVPool
    from gpu_worker.tensor_parallel import TensorParallel

ALL_REDUCE = Callable[[torch.Tensor], None]


class Backend(Protocol):
    """What the runner asks of a device backend."""

    name: str
    device: torch.device
    host_memory: bool  # tensors live in host memory (the grammar mask is applied in place there)

    def auto_dtype(self, gguf_blocks: bool) -> str:
        """``--dtype auto``: the activations' dtype (``gguf_blocks``: weights kept in GGUF blocks)."""
        ...

    def tower_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """A vision tower's dtype under ``--dtype auto`` when the activations are ``dtype``: a tower
        is dense matmuls and attention over thousands of patches, compute-bound where a decode step
        is bound by its weight bytes, so it may take a narrower type than the language model."""
        ...

    def kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """``--kv-cache-dtype auto`` under activations of ``dtype`` (asked after ``prepare_model``).

        A method, not a constant: whether a 16-bit pool pays depends on the backend's attention
        reading it in place. A decode step at a long context reads more KV than weights, and 16
        bits halve it; a path that gathers and widens the KV per read (torch's) pays a copy for it
        and keeps the activations' dtype. The float64 reference stays float64 on every backend."""
        ...

    def quantized_types(self) -> frozenset[int]:
        """The ggml block types this backend computes on (the loader keeps those in their blocks)."""
        ...

    def kv_pool_tokens(self, configured: int, mem_fraction: float, bytes_per_token: int) -> int:
        """The KV pool's size in tokens: ``configured`` if > 0, else a share of free memory."""
        ...

    def kv_pool_ceiling(self, configured: int) -> int | None:
        """The most tokens ``kv_pool_tokens`` can give, before the model's shapes are known; None:
        no bound until then."""
        ...

    def prepare_model(self, model: nn.Module, dtype: torch.dtype, tp: TensorParallel | None) -> None:
        """Ready a loaded model: under tensor parallel (``tp``) this rank's shard of it, by each
        layer's declared ``Split``, and the all-reduce around its row-parallel matmuls
        (``tensor_parallel.prepare_rank``); then weight layouts and kernels, set only through each
        layer's declared kernel slots (``Layer.attach``, models/contract.py). The one owner of what a
        loaded model's modules compute with: nothing else shards, wraps or lays them out."""
        ...

    def init_forward_metadata(
        self, kv: KVPool, req_pool_idx: list[int], prefix_lens: list[int], extend_lens: list[int]
    ) -> tuple[torch.Tensor, Any]:
        """Positions [T] and the batch's attention metadata, built once for every layer."""
        ...

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        options: AttentionOptions,
    ) -> torch.Tensor:
        """Write the batch's new K/V of ``layer`` into the pool, then attend every row over its pages."""
        ...

    def forward_decode(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """The whole model in one call for an all-decode step, where the backend has one (else None)."""
        ...

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The first maximal index of each row."""
        ...

    def all_reduce(self, config: WorkerConfig) -> ALL_REDUCE:
        """The tensor-parallel sum over ranks (in place), for ``prepare_model``'s ``tp``."""
        ...

    def before_batch(self, rows: int, tokens: int) -> None:
        """Per-batch host settings (the CPU's thread count for this batch shape)."""
        ...

    def after_batch(self, seconds: float) -> None:
        """How long the batch took (the CPU's thread tuner learns from it)."""
        ...
