"""Tiny random latent-attention models (DeepSeek-V2/V3, GLM-4.7-Flash), float64, as HF saves them."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

VOCAB = 500
# kind -> what it covers
KINDS = (
    "v2_lite",  # DeepSeek-V2-Lite's shape: no q_lora_rank, softmax greedy top-k, complex rope
    "v2_group",  # DeepSeek-V2: q_lora_rank, group-limited greedy, routed_scaling_factor
    "v3",  # DeepSeek-V3: sigmoid, bias-corrected group top-k, interleaved rope, YaRN + mscale
    "glm",  # GLM-4.7-Flash: K 24 + 8 against V 32, mlp_layer_types, interleaved rope
)


def tiny_mla_config(kind: str, **sizes: int) -> Any:
    """``sizes``: the head sizes etc. changed from the tiny defaults."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, initializer_range=0.3, num_hidden_layers=3,
        num_experts_per_tok=2, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
    )  # fmt: skip
    common.update(sizes)
    match kind:
        case "v2_lite":
            return transformers.DeepseekV2Config(q_lora_rank=None, first_k_dense_replace=1,
                                                 n_shared_experts=2, **common)  # fmt: skip
        case "v2_group":
            return transformers.DeepseekV2Config(
                q_lora_rank=24, first_k_dense_replace=1, n_shared_experts=1, n_group=4, topk_group=2,
                topk_method="group_limited_greedy", routed_scaling_factor=1.5, **common,
            )  # fmt: skip
        case "v3":
            rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                        mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0)  # fmt: skip
            return transformers.DeepseekV3Config(
                q_lora_rank=24, first_k_dense_replace=1, n_group=4, topk_group=2, n_shared_experts=1,
                rope_parameters=rope, **common,
            )  # fmt: skip
        case "glm":
            common.update(qk_nope_head_dim=24, v_head_dim=32)
            return transformers.Glm4MoeLiteConfig(
                q_lora_rank=24, n_shared_experts=1, mlp_layer_types=["sparse", "dense", "sparse"], **common
            )
    raise ValueError(kind)


def hf_mla_model(kind: str, seed: int = 0, **sizes: int) -> Any:
    """A random float64 HF model of ``kind`` (eager experts), norms perturbed from 1 and, where the
    router has one, a random score-correction bias (so that it changes the selection)."""
    import transformers

    torch.manual_seed(seed)
    model: Any = transformers.AutoModelForCausalLM.from_config(
        tiny_mla_config(kind, **sizes), experts_implementation="eager"
    )
    model = model.to(torch.float64).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.3)
    return model


def save_mla_model(kind: str, out: Path, seed: int = 0) -> Any:
    model = hf_mla_model(kind, seed)
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
