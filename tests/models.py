"""Tiny random models of every family rivulet serves, saved the way HF saves them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from protocol.sampling import WorkerSampling

FAMILIES = ("llama", "qwen2", "qwen3", "gpt2", "gemma2", "gemma3_text", "phi3", "mistral_window")
# More configs of those families (rope scalings, a multimodal config), for tests/gpu_worker/test_families.py.
VARIANTS = ("llama3_rope", "qwen2_yarn", "phi3_longrope", "phi4_mini", "gemma3")
WINDOW = 16  # the tiny models' sliding window: shorter than most test prompts
GREEDY = WorkerSampling(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0)
VOCAB = 500


def tiny_config(kind: str, tie: bool) -> Any:
    """A 2-layer (Gemma: 3), hidden-64 config of ``kind``: llama | qwen2 | qwen3 | gpt2 | mistral, a
    family of FAMILIES or a variant of VARIANTS. Sliding windows are WINDOW tokens."""
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
        case "mistral_window":
            return transformers.MistralConfig(sliding_window=WINDOW, **decoder)
        case "llama3_rope":
            rope = dict(rope_type="llama3", rope_theta=5000.0, factor=8.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position_embeddings=32)  # fmt: skip
            return transformers.LlamaConfig(rope_parameters=rope, **decoder)
        case "qwen2_yarn":
            rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)
            return transformers.Qwen2Config(rope_parameters=rope, **decoder)
        case "phi3" | "phi3_longrope" | "phi4_mini":
            return _phi3_config(kind != "phi3", decoder, partial=0.75 if kind == "phi4_mini" else 1.0)
        case "gemma2" | "gemma3_text" | "gemma3":
            return _gemma_config(kind, decoder)
    raise ValueError(kind)


def _phi3_config(longrope: bool, decoder: dict[str, Any], partial: float = 1.0) -> Any:
    """Phi-3 with a sliding window (Phi-3-mini-4k has one); LongRoPE over a 64-token original length;
    ``partial`` < 1: only that share of each head rotates (Phi-4-mini: 0.75, with LongRoPE)."""
    import transformers

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}
    if longrope:
        half = int(64 // 4 * partial) // 2  # head_dim 16 * partial / 2 factors
        rope = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=64,
                    short_factor=[1.0 + 0.1 * i for i in range(half)],
                    long_factor=[2.0 + 0.5 * i for i in range(half)],
                    partial_rotary_factor=partial)  # fmt: skip
    return transformers.Phi3Config(
        sliding_window=None if longrope else WINDOW, rope_parameters=rope, pad_token_id=0,
        original_max_position_embeddings=64, **decoder,
    )  # fmt: skip


def _gemma_config(kind: str, decoder: dict[str, Any]) -> Any:
    """Gemma 2 (soft-capping, query_pre_attn_scalar != head_dim), Gemma 3 text (QK norms, local and
    global rope, linear scaling on the global layers), or Gemma 3's multimodal config around it."""
    import transformers

    gemma = {**decoder, "num_hidden_layers": 3, "head_dim": 32, "sliding_window": WINDOW}
    if kind == "gemma2":
        return transformers.Gemma2Config(
            query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0, **gemma
        )
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
    }
    layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    text = dict(query_pre_attn_scalar=32, rope_parameters=rope, layer_types=layer_types, **gemma)
    if kind == "gemma3_text":
        return transformers.Gemma3TextConfig(**text)
    text.pop("tie_word_embeddings")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=32, patch_size=16)  # fmt: skip
    tie = bool(decoder["tie_word_embeddings"])
    return transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 1,
        boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2, tie_word_embeddings=tie,
    )  # fmt: skip


def save_tiny_model(kind: str, tie: bool, out: Path, seed: int = 0) -> Any:
    """Save a random float64 HF model of ``kind`` to ``out``; return it (eval mode, float64)."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(kind, tie)
    model: Any
    if kind == "gemma3":  # the multimodal model, whose language model we serve
        model = transformers.Gemma3ForConditionalGeneration(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.to(torch.float64).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: perturb so they are tested
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                param.add_(torch.randn_like(param) * 0.1)
        if kind.startswith("gemma"):  # x sqrt(hidden) at the input: a tied head would echo the token
            model.get_input_embeddings().weight.mul_(0.03)
    model.save_pretrained(out, safe_serialization=True)
    return model
