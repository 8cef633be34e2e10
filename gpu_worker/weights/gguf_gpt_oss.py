"""gpt-oss's GGUF (``gpt-oss``, as llama.cpp's converter writes it): its tensor names and its config.

The converter splits HF's stacked ``gate_up_proj`` (gate and up rows interleaved) into
``ffn_gate_exps`` and ``ffn_up_exps`` (each [experts, inner, hidden], biases [experts, inner]), keeps
the experts in MXFP4 (its blocks repacked from HF's ``*_blocks`` / ``*_scales``), names the sinks
``attn_sinks.weight`` and the router ``ffn_gate_inp``. The file states neither the clamped SwiGLU's
alpha and limit (llama.cpp uses gpt-oss's 1.702 and 7.0), nor the layer types (even layers slide,
as HF's default alternation), nor YaRN's ``truncate`` (gpt-oss's config: false).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

GPT_OSS_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_sinks.weight": "self_attn.sinks",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def gpt_oss_config(decoder: dict[str, Any], key: Callable[..., Any]) -> dict[str, Any]:
    """HF's GptOssConfig fields from the decoder's common ones and the file's ``gpt-oss.*`` keys."""
    layers = decoder["num_hidden_layers"]
    rope = decoder["rope_parameters"]
    if rope.get("rope_type") == "yarn":  # gpt-oss's own: its correction range is not rounded
        rope["truncate"] = False
    return decoder | {
        "model_type": "gpt_oss",
        "hidden_act": "silu",
        "attention_bias": True,
        "num_local_experts": int(key("expert_count")),
        "num_experts_per_tok": int(key("expert_used_count")),
        "intermediate_size": int(key("expert_feed_forward_length")),
        "swiglu_alpha": SWIGLU_ALPHA,
        "swiglu_limit": SWIGLU_LIMIT,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
    }
