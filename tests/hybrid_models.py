"""Tiny random hybrid models (Gated DeltaNet and full attention layers): Qwen3.5 dense, its
multimodal config, Qwen3.5-MoE and Qwen3-Next, saved the way HF saves them."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

HYBRID_KINDS = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_next")
VOCAB = 500


def tiny_hybrid_config(kind: str, layers: int = 4) -> Any:
    """Hidden 64, ``layers`` layers (every fourth full attention), 2 key heads of 8 under 4 value heads
    of 12 (so key heads repeat onto value heads), MoE: 4 experts of 16, top 2, a shared expert."""
    import transformers

    text: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_conv_kernel_dim=4, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        initializer_range=0.3,
    )  # fmt: skip
    moe: dict[str, Any] = dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24
    )
    match kind:
        case "qwen3_5_text":
            return transformers.Qwen3_5TextConfig(**text)
        case "qwen3_5":
            vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
            return transformers.Qwen3_5Config(text_config=text, vision_config=vision)
        case "qwen3_5_moe_text":
            return transformers.Qwen3_5MoeTextConfig(**text, **moe)
        case "qwen3_next":
            return transformers.Qwen3NextConfig(**text, **moe, norm_topk_prob=True)
    raise ValueError(kind)


def hf_hybrid_model(kind: str, seed: int = 0, layers: int = 4) -> Any:
    """A random float64 HF model of ``kind`` (eager experts), every norm and the decay perturbed."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_hybrid_config(kind, layers)
    model: Any
    if kind == "qwen3_5":
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    model = model.to(torch.float64).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def save_hybrid(kind: str, out: Path, seed: int = 0, layers: int = 4) -> Any:
    model = hf_hybrid_model(kind, seed, layers)
    model.save_pretrained(out, safe_serialization=True)
    return model


def hf_greedy(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


def make_prompts(seed: int, lens: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lens]
