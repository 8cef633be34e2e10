"""Our model implementations, chosen by the HF config's ``model_type``.

Every model exposes ``num_layers``, ``num_kv_heads``, ``head_dim`` and
``context_len``, ``forward(input_ids, ctx) -> hidden [T, H]`` (before the final
norm) and ``compute_logits(hidden) -> [N, vocab]``.
"""

from __future__ import annotations

from torch import nn


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
