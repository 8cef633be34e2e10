"""Tiny random models of every family rivulet serves, saved the way HF saves them."""

from __future__ import annotations

from pathlib import Path

VOCAB = 512
FAMILIES = ("llama", "qwen2", "qwen3", "gpt2")


def make_tiny_model(family: str, out: Path, *, seed: int = 0) -> Path:
    """Save a random 2-layer ``family`` model (float32 weights, safetensors) to ``out``."""
    import torch
    import transformers as tf

    common = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2}
    llama_like = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        **common,
    }
    configs = {
        "llama": lambda: tf.LlamaConfig(tie_word_embeddings=False, **llama_like),
        "qwen2": lambda: tf.Qwen2Config(tie_word_embeddings=True, **llama_like),
        "qwen3": lambda: tf.Qwen3Config(tie_word_embeddings=False, head_dim=32, **llama_like),
        "gpt2": lambda: tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common),
    }
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(configs[family]())
    with torch.no_grad():  # random biases/norm weights, so a missed one shows up in the outputs
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    return out
