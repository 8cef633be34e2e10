"""The Triton backend: paged attention and the K/V write as Triton kernels, everything else torch.

The default on CUDA. ``--device-backend triton`` selects it on the CPU too, where its kernels
run under Triton's interpreter (slowly, element for element as written): that is how every
machine without a GPU tests them end to end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gpu_worker.backends.torch import attention as torch_attention
from gpu_worker.backends.torch.attention import Blocks, kv_locations
from gpu_worker.backends.torch.backend import TorchBackend

if TYPE_CHECKING:
    from torch import nn

    from gpu_worker.backends.triton.kernels import AttentionRows
    from gpu_worker.forward_context import AttentionOptions, ForwardContext
    from gpu_worker.kv_cache import KVPool
    from gpu_worker.tensor_parallel import TensorParallel


@dataclass(frozen=True)
class TritonMetadata:
    """Where the batch's new K/V go, and its rows as the attention kernel reads them."""

    out_locs: torch.Tensor  # int64 [T] pool rows of the new tokens
    token_req_pool_idx: torch.Tensor  # int64 [T] each token's row of the page table
    rows: AttentionRows
    page_table: torch.Tensor
    page_size: int


class TritonBackend(TorchBackend):
    """Paged attention of decode, extend and mixed rows in one or two launches per layer; the rest is
    the torch backend's."""

    name = "triton"

    def __init__(self, device: torch.device) -> None:
        # Imported here: the kernel modules turn the interpreter on where no CUDA device is present.
        from gpu_worker.backends.triton import kernels

        super().__init__(device)
        self._kernels = kernels

    def prepare_model(self, model: nn.Module, dtype: torch.dtype, tp: TensorParallel | None) -> None:
        """The torch backend's, the Gated DeltaNet layers' ``pooled_rule``: the gated delta rule's
        Triton kernels over the state pool (gated_delta.py; the conv1d stays torch's), and latent
        attention's ``pooled_attention``: both its forms on Triton kernels (mla.py)."""
        super().prepare_model(model, dtype, tp)
        from gpu_worker.backends.triton import gated_delta, mla
        from gpu_worker.models.gated_delta import GatedDeltaNet
        from gpu_worker.models.mla import LatentAttention

        for module in model.modules():
            if isinstance(module, GatedDeltaNet):
                module.attach(pooled_rule=gated_delta)
            elif isinstance(module, LatentAttention):
                module.attach(pooled_attention=mla.pooled_attention)

    def kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """bfloat16 under float32 activations on a GPU: the kernels read a 16-bit pool in place (fp32
        math). Interpreted on the CPU (a test path) the activations', as torch's backend keeps."""
        return torch.bfloat16 if dtype == torch.float32 and not self.host_memory else dtype

    def init_forward_metadata(
        self, kv: KVPool, req_pool_idx: list[int], prefix_lens: list[int], extend_lens: list[int]
    ) -> tuple[torch.Tensor, Any]:
        rows = self._kernels.attention_rows(req_pool_idx, prefix_lens, extend_lens, self.device)
        # Each token's row, then its position and the pool row its K/V go to.
        lens = torch.tensor(extend_lens, device=self.device)
        row_of_token = torch.repeat_interleave(
            torch.arange(len(extend_lens), device=self.device), lens, output_size=rows.num_tokens
        )
        starts = rows.q_starts[:-1].to(torch.int64)
        positions = (
            rows.prefix_lens.to(torch.int64)[row_of_token]
            + torch.arange(rows.num_tokens, device=self.device)
            - starts[row_of_token]
        )
        pool_rows = rows.req_pool_idx.to(torch.int64)[row_of_token]
        out_locs = kv_locations(kv.page_table, kv.page_size, pool_rows, positions)
        return positions, TritonMetadata(out_locs, pool_rows, rows, kv.page_table, kv.page_size)

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        options: AttentionOptions,
    ) -> torch.Tensor:
        meta: TritonMetadata = ctx.attn
        k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
        self._kernels.write_kv(k_cache, v_cache, k, v, meta.out_locs)
        if ctx.images is not None and ctx.images.blocks:  # an image's tokens attend both ways: torch's masks
            return _attend_with_blocks(meta, q, k, v, k_cache, v_cache, options, ctx.images.blocks)
        out = torch.empty_like(q)
        scale = options.scale if options.scale is not None else 1 / math.sqrt(q.shape[-1])
        self._kernels.paged_attention(
            q, k_cache, v_cache, out, meta.page_table, meta.page_size, meta.rows, scale,
            options.sliding_window, options.logit_softcap, options.sinks,
        )  # fmt: skip
        return out


def _attend_with_blocks(
    meta: TritonMetadata,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    options: AttentionOptions,
    blocks: Blocks,
) -> torch.Tensor:
    """A batch with images whose tokens attend to each other (Gemma 3's): the torch backend's masks
    over every row (the kernel is causal); its K/V already written."""
    rows = meta.rows
    starts = rows.q_starts.tolist()
    extend_lens = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
    _, torch_meta = torch_attention.build_metadata(
        meta.page_table,
        meta.page_size,
        rows.req_pool_idx.tolist(),
        rows.prefix_lens.tolist(),
        extend_lens,
        q.device,
    )
    return torch_attention.attend(
        torch_meta, q, k, v, k_cache, v_cache, options, write_kv=False, blocks=blocks
    )
