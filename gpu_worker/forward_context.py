"""What a model's forward needs besides its token ids, and the one attention call model files make.

A model file says ``paged_attention(layer, q, k, v, ctx)``; which kernel attends (torch, the CPU's
C kernel, Triton) is the business of the backend the runner put in ``ctx``
(gpu_worker/backends/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from gpu_worker.image_encoder import ImageSplice
    from gpu_worker.recurrent_state import RecurrentBatch


class PagedAttention(Protocol):
    """A backend's attention over the paged KV pool (gpu_worker/backends/)."""

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext,
        options: AttentionOptions,
    ) -> torch.Tensor: ...  # fmt: skip


@dataclass(frozen=True)
class AttentionOptions:
    """One layer's attention beyond plain causal softmax(q k^T / sqrt(D)) v."""

    scale: float | None = None  # None: 1 / sqrt(head_dim)
    sliding_window: int = 0  # > 0: a query at position p sees only positions > p - sliding_window
    logit_softcap: float = 0.0  # > 0: scores = softcap * tanh(scores / softcap)
    # [Hq]: a learned logit per query head joining every softmax with no value (gpt-oss's sinks):
    # the weights of the real positions sum to 1 - its share
    sinks: torch.Tensor | None = None


PLAIN = AttentionOptions()


@dataclass(frozen=True)
class BatchRows:
    """The batch's rows as the scheduler sent them, and the page table they index: what a layer that
    reads the pool itself needs (latent attention's expanded form, models/mla.py)."""

    req_pool_idx: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    page_table: torch.Tensor  # [max_requests, pages per request]
    page_size: int


@dataclass(frozen=True)
class ForwardContext:
    """One batch's positions and attention metadata, the KV pool, and the backend that attends."""

    positions: torch.Tensor  # [T] position of every token
    attn: Any  # the backend's per-batch metadata, built once and read by every layer
    k_cache: list[torch.Tensor]  # per layer [num_pages * page_size, kv_heads, head_dim]
    v_cache: list[torch.Tensor]
    backend: PagedAttention
    recurrent: RecurrentBatch | None = None  # a hybrid model's: its rows' recurrent-state slots
    images: ImageSplice | None = None  # the image positions' embeddings (image_encoder.py)
    # [3, T] (time, row, column) positions of a multimodal rope (Qwen3.5's, models/qwen35_positions.py)
    # when the batch has image tokens; None: each token's are its ``positions`` on all three axes.
    mrope: torch.Tensor | None = None
    rows: BatchRows | None = None
    latent_form: str = "auto"  # latent attention: auto | absorbed | expanded (--latent-attention)


def paged_attention(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: ForwardContext,
    options: AttentionOptions = PLAIN,
) -> torch.Tensor:
    """Write layer ``layer``'s new K/V into the pool, then attend. q: [T, Hq, D], k/v: [T, Hkv, D]."""
    return ctx.backend.attention(layer, q, k, v, ctx, options)
