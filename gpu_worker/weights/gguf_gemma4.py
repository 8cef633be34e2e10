"""A ``gemma4`` GGUF's metadata -> Gemma 4's HF text config (gguf_config.py's builder for it).

llama.cpp's converter states per layer what HF's config derives: the feed-forward length (an array
where the KV-shared layers' MLPs are double-wide), the KV head count (an array: global layers have
their own), the sliding-window pattern (an array of bools), the global and sliding head sizes
(``key_length`` / ``key_length_swa``). It writes no flag for k = v (a global layer without an
``attn_v`` tensor), for the per-layer vocabulary (``per_layer_token_embd``'s rows), nor for the
global layers' partial rotation: its ``rope_freqs`` tensor, which only they read, holds 1 for each
rotated pair and 1e30 (no rotation) for the rest, from which HF's "proportional" share is restated.
The head sizes and KV heads go into ``per_layer_config`` as HF's config holds them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gpu_worker.weights.gguf_file import GgufHeader, read_header

SLIDING, FULL = "sliding_attention", "full_attention"


def gemma4_config(header: GgufHeader) -> dict[str, Any]:
    """The config.json dict of a ``gemma4`` file."""
    md = header.metadata

    def key(name: str, default: Any = None) -> Any:
        return md.get(f"gemma4.{name}", default)

    layers = int(key("block_count"))
    embedding = header.tensor("token_embd.weight")
    assert embedding is not None, f"{header.path} has no token_embd.weight"
    pattern = key("attention.sliding_window_pattern")
    sliding = list(pattern) if isinstance(pattern, list) else [False] * layers
    types = [SLIDING if s else FULL for s in sliding]
    shared = int(key("attention.shared_kv_layers", 0))
    config: dict[str, Any] = {
        "model_type": "gemma4_text",
        "vocab_size": int(embedding.shape[1]),
        "hidden_size": int(key("embedding_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": int(key("attention.head_count")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": header.tensor("output.weight") is None,
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": types,
        "final_logit_softcapping": key("final_logit_softcapping"),
        "num_kv_shared_layers": shared,
        "attention_bias": False,
    }
    if key("attention.sliding_window"):
        config["sliding_window"] = int(key("attention.sliding_window"))
    # Whether an image's tokens see each other both ways is not in the file; llama.cpp's mtmd takes
    # the released checkpoints' choice by width (E2B's 1536 and E4B's 2560 causal, the rest "vision"),
    # and so do we (it acts only where images are given, with --mmproj).
    if config["hidden_size"] not in (1536, 2560):
        config["use_bidirectional_attention"] = "vision"
    for name in ("bos", "eos", "padding"):
        token = md.get(f"tokenizer.ggml.{name}_token_id")
        if token is not None:
            config[f"{'pad' if name == 'padding' else name}_token_id"] = int(token)
    _attention(header, config, key, shared)
    _feed_forward(header, config, key, shared)
    return config


def _per_layer(value: Any, layers: int) -> list[int]:
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers


def _attention(header: GgufHeader, config: dict[str, Any], key: Any, shared: int) -> None:
    """Head sizes and KV heads per layer type, k = v, and each type's rope."""
    layers, types = config["num_hidden_layers"], config["layer_types"]
    full_dim = int(key("attention.key_length"))
    sliding_dim = int(key("attention.key_length_swa", full_dim))
    kv_heads = _per_layer(key("attention.head_count_kv", config["num_attention_heads"]), layers)
    config["head_dim"] = sliding_dim
    sliding_heads = [kv_heads[i] for i in range(layers) if types[i] == SLIDING]
    config["num_key_value_heads"] = sliding_heads[0] if sliding_heads else kv_heads[0]
    config["per_layer_config"] = {
        str(i): {"head_dim": full_dim, "num_key_value_heads": kv_heads[i]}
        for i in range(layers)
        if types[i] == FULL
    }
    owners = range(layers - shared)
    config["attention_k_eq_v"] = any(
        types[i] == FULL and header.tensor(f"blk.{i}.attn_v.weight") is None for i in owners
    )
    factors = header.read_floats("rope_freqs.weight")
    rotated = full_dim // 2 if factors is None else sum(1 for f in factors if f == 1.0)
    swa_rotary = int(key("rope.dimension_count_swa", sliding_dim))
    if swa_rotary != sliding_dim:
        raise ValueError(f"{header.path}: sliding layers rotating {swa_rotary} of {sliding_dim} dims")
    config["rope_parameters"] = {
        FULL: {
            "rope_type": "proportional",
            "rope_theta": float(key("rope.freq_base", 1_000_000.0)),
            "partial_rotary_factor": 2 * rotated / full_dim,
        },
        SLIDING: {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", 10_000.0))},
    }


def _feed_forward(header: GgufHeader, config: dict[str, Any], key: Any, shared: int) -> None:
    """The MLP's width (twice it on the KV-shared layers where the array says), the per-layer
    inputs, and the MoE block beside each MLP."""
    layers = config["num_hidden_layers"]
    widths = _per_layer(key("feed_forward_length"), layers)
    config["intermediate_size"] = widths[0]
    config["use_double_wide_mlp"] = shared > 0 and widths[-1] == 2 * widths[0]
    per_layer = int(key("embedding_length_per_layer_input", 0) or 0)
    config["hidden_size_per_layer_input"] = per_layer
    table = header.tensor("per_layer_token_embd.weight")
    if per_layer and table is not None:
        config["vocab_size_per_layer_input"] = int(table.shape[1])
    experts = int(key("expert_count", 0) or 0)
    config["enable_moe_block"] = experts > 0
    if experts:
        config["num_experts"] = experts
        config["top_k_experts"] = int(key("expert_used_count"))
        config["moe_intermediate_size"] = int(key("expert_feed_forward_length"))


GATE_UP = "gate_up_proj"
# The converter's layer tensor names -> HF's (gguf_names.py's table for "gemma4"): Gemma 3's, the
# per-layer input's, the MoE block's; a name with its kind (``.weight``, ``.scale``) maps to a whole
# HF name: the router's scales, the layer scalar. The stacked experts load as other families' do
# (per projection, ``experts.{gate,up,down}_proj.weight`` [E, rows, cols]), the file's gate_up
# split in two first (``split_gate_up``). Norms are stored as they are (Gemma 4 scales by w).
GEMMA4_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "ffn_gate_inp": "router.proj",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "layer_output_scale.weight": "layer_scalar",
    "ffn_gate_up_exps.weight": f"experts.{GATE_UP}.weight",
    "ffn_down_exps": "experts.down_proj",
}
GEMMA4_GLOBALS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}


Entry = tuple[str, int, np.ndarray, tuple[int, ...]]  # gguf_weights.read_tensors's


def split_gate_up(entries: Iterator[Entry]) -> Iterator[Entry]:
    """The entries, a stacked gate_up [E, 2I, H] (gate rows first, as HF and llama.cpp hold it) as
    its gate [E, I, H] and up [E, I, H], whole rows of its blocks copied apart."""
    for name, ggml_type, data, shape in entries:
        if not name.endswith(f".experts.{GATE_UP}.weight"):
            yield name, ggml_type, data, shape
            continue
        experts, rows, cols = shape
        halves = data.reshape(experts, 2, rows // 2, data.shape[-1])
        prefix = name.removesuffix(f"{GATE_UP}.weight")
        for i, proj in enumerate(("gate_proj", "up_proj")):
            part = np.ascontiguousarray(halves[:, i]).reshape(experts * rows // 2, data.shape[-1])
            yield f"{prefix}{proj}.weight", ggml_type, part, (experts, rows // 2, cols)


MEDIA_TOKENS = ("<|image|>", "<|video|>", "<|audio|>")


def media_token_ids(path: Path) -> list[int]:
    """The ids of the media placeholders in a ``gemma4`` file's vocabulary (HF's multimodal model
    embeds them as the pad token, as a text-only one does not): for a GGUF served with --mmproj and
    no config.json of the multimodal checkpoint."""
    tokens = read_header(path, ("tokenizer.ggml.tokens",)).metadata.get("tokenizer.ggml.tokens") or []
    index = {token: i for i, token in enumerate(tokens)}
    return [index[token] for token in MEDIA_TOKENS if token in index]
