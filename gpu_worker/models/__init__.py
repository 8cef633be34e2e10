"""Our model implementations, chosen by the HF config's ``model_type``.

Every model exposes ``num_layers``, ``num_kv_heads``, ``head_dim`` and
``context_len``, ``forward(input_ids, ctx) -> hidden [T, H]`` (before the final
norm) and ``compute_logits(hidden) -> [N, vocab]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from torch import nn

if TYPE_CHECKING:
    import torch

    from gpu_worker.forward_context import ForwardContext


class CausalLM(Protocol):
    """What the runner needs of a model (our nn.Modules satisfy it)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_len: int

    def __call__(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def model_class(model_type: str) -> type[nn.Module]:
    """The module class that implements ``model_type``."""
    match model_type:
        case "llama" | "mistral" | "qwen2" | "qwen3":
            from gpu_worker.models.llama import LlamaForCausalLM

            return LlamaForCausalLM
        case "gpt2":
            from gpu_worker.models.gpt2 import GPT2LMHeadModel

            return GPT2LMHeadModel
        case _:
            raise NotImplementedError(f"model type {model_type!r} is not supported")
