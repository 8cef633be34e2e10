"""Tiny random models of every family rivulet serves, saved the way HF saves them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from protocol.sampling import WorkerSampling

FAMILIES = ("llama", "qwen2", "qwen3", "gpt2")
GREEDY = WorkerSampling(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0)
VOCAB = 500


def tiny_config(kind: str, tie: bool) -> Any:
    """A 2-layer, hidden-64 config of ``kind`` (llama | qwen2 | qwen3 | gpt2 | mistral)."""
    import transformers

    # initializer_range 0.3: with the default 0.02 a random model just echoes its last token.
    common: dict[str, Any] = dict(
        vocab_size=VOCAB, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, initializer_range=0.3
    )
    if kind == "gpt2":
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **common)
    decoder: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **common,
    )
    match kind:
        case "llama":
            return transformers.LlamaConfig(
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, **decoder
            )
        case "qwen2":
            return transformers.Qwen2Config(**decoder)
        case "qwen3":
            return transformers.Qwen3Config(head_dim=32, **decoder)
        case "mistral":
            return transformers.MistralConfig(sliding_window=None, **decoder)
    raise ValueError(kind)


def save_tiny_model(kind: str, tie: bool, out: Path, seed: int = 0) -> Any:
    """Save a random float64 HF model of ``kind`` to ``out``; return it (eval mode, float64)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind, tie))
    model = model.to(torch.float64).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: perturb so they are tested
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    return model
