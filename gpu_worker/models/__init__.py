"""Our model implementations, chosen by the HF config's ``model_type``.

Every model exposes ``num_layers``, ``num_kv_heads``, ``head_dim`` and
``context_len``, ``forward(input_ids, ctx) -> hidden [T, H]`` (before the final
norm), ``compute_logits(hidden) -> [N, vocab]`` and ``decoder_layers()``; it builds its layers from
the worker's layer types (contract.py).

Importing this package imports no torch: the launcher checks ``SUPPORTED_MODEL_TYPES`` before
any process starts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gpu_worker.forward_context import ForwardContext

# model_type -> (module under gpu_worker.models, class). Mistral runs on Llama's code; "gemma3" is
# the multimodal config, whose text model we serve (its text_config); "gemma4" likewise.
_MODELS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("llama", "LlamaForCausalLM"),
    "qwen2": ("llama", "LlamaForCausalLM"),
    "qwen3": ("llama", "LlamaForCausalLM"),
    "qwen3_moe": ("moe", "Qwen3MoeForCausalLM"),
    "mixtral": ("moe", "MixtralForCausalLM"),
    "gemma2": ("gemma", "GemmaForCausalLM"),
    "gemma3_text": ("gemma", "GemmaForCausalLM"),
    "gemma3": ("gemma", "GemmaForCausalLM"),
    "gemma4_text": ("gemma4", "Gemma4ForCausalLM"),
    "gemma4": ("gemma4", "Gemma4ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gpt2": ("gpt2", "GPT2LMHeadModel"),
    "deepseek_v2": ("deepseek", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("deepseek", "DeepseekV3ForCausalLM"),
    "glm4_moe_lite": ("deepseek", "Glm4MoeLiteForCausalLM"),
    "qwen3_5": ("qwen35", "Qwen35ForCausalLM"),
    "qwen3_5_text": ("qwen35", "Qwen35ForCausalLM"),
    "qwen3_5_moe": ("qwen35", "Qwen35MoeForCausalLM"),
    "qwen3_5_moe_text": ("qwen35", "Qwen35MoeForCausalLM"),
    "qwen3_next": ("qwen35", "Qwen3NextForCausalLM"),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM"),
}
SUPPORTED_MODEL_TYPES = tuple(_MODELS)


class CausalLM(Protocol):
    """What the runner needs of a model (our nn.Modules satisfy it)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_len: int
    tensor_parallel: tuple[int, int] | None  # (rank, world), set by tensor_parallel.shard

    def decoder_layers(self) -> nn.ModuleList: ...

    def __call__(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def model_class(model_type: str) -> type[nn.Module]:
    """The module class that implements ``model_type``."""
    if model_type not in _MODELS:
        raise NotImplementedError(
            f"model type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    module, name = _MODELS[model_type]
    cls: type[nn.Module] = getattr(importlib.import_module(f"gpu_worker.models.{module}"), name)
    return cls
