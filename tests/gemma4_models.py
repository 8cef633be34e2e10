"""Tiny random Gemma 4 models with every option of the family on, saved the way HF saves them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.models import VOCAB, WINDOW

# Owners [sliding, full, sliding, full], then two KV-shared layers (sliding, full) reading layers 2, 3.
LAYER_TYPES = ["sliding_attention", "full_attention"] * 3
ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 100000.0},
}


def gemma4_text_config(**overrides: Any) -> Any:
    """Six layers, hidden 64: per-layer embeddings, two KV-shared layers with double-wide MLPs,
    global layers with their own head size (32, sliding 16) and KV heads (1, sliding 2) and k = v,
    proportional rope, a MoE block of 4 experts (top 2), final soft-capping, a WINDOW-token window."""
    import transformers

    fields: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=WINDOW,
        layer_types=list(LAYER_TYPES), rope_parameters=ROPE, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2, use_double_wide_mlp=True,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        final_logit_softcapping=3.0, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, initializer_range=0.3, tie_word_embeddings=True,
    )  # fmt: skip
    fields.update(overrides)
    return transformers.Gemma4TextConfig(**fields)


def gemma4_config(**overrides: Any) -> Any:
    """The multimodal config around ``gemma4_text_config``'s text model (a tiny vision tower)."""
    import transformers

    text = gemma4_text_config(**overrides).to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64)  # fmt: skip
    return transformers.Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None, image_token_id=VOCAB - 1,
        boi_token_id=VOCAB - 3, eoi_token_id=VOCAB - 2, video_token_id=VOCAB - 4,
        boa_token_id=VOCAB - 5, eoa_token_index=VOCAB - 6, audio_token_id=VOCAB - 7,
    )  # fmt: skip


def save_gemma4(out: Path, multimodal: bool = False, seed: int = 0, **overrides: Any) -> Any:
    """Save a random float64 HF Gemma 4 to ``out``; return it (eval mode, float64, eager experts)."""
    import transformers

    torch.manual_seed(seed)
    model: Any
    if multimodal:
        model = transformers.Gemma4ForConditionalGeneration(gemma4_config(**overrides))
    else:
        model = transformers.Gemma4ForCausalLM(gemma4_text_config(**overrides))
    model = model.to(torch.float64).eval()
    model.set_experts_implementation("eager")  # its loop over experts, as ours sums them
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    with torch.no_grad():  # random init leaves norms and scales at 1: perturb so they are tested
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("scale", "layer_scalar")):
                param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.add_(torch.randn_like(buffer) * 0.1)
        # x sqrt(hidden) at the input: a tied head would echo the token
        model.get_input_embeddings().weight.mul_(0.03)
    model.save_pretrained(out, safe_serialization=True)
    return model
