"""A tiny HF Gemma 4 written as a ``gemma4`` GGUF the way llama.cpp's converter writes one
(conversion/gemma.py's Gemma4Model in the llama-cpp-python sdist): names from the ``gguf`` package's
own HF -> GGUF map (not from the loader under test), norms as they are (no 1 + w), the router's
scales as ``ffn_gate_inp.scale`` / ``ffn_down_exps.scale``, the layer scalar as
``layer_output_scale.weight``, stacked experts as ``ffn_gate_up_exps`` / ``ffn_down_exps``, per-layer
arrays for the feed-forward length and KV heads, and the global layers' partial rotation as a
``rope_freqs`` tensor (1 per rotated pair, 1e30 for the rest)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from tests.gguf_writer import _add_tensor, copy_tokenizer

_TEXT_PREFIX = re.compile(r"^model\.language_model\.")
_TOWERS = re.compile(r"^model\.(vision_tower|audio_tower|embed_vision|embed_audio)\.")
_RENAMES = (  # the converter's own names for what gguf's map does not name
    (re.compile(r"\.router\.scale$"), "ffn_gate_inp.scale"),
    (re.compile(r"\.router\.per_expert_scale$"), "ffn_down_exps.scale"),
    (re.compile(r"\.layer_scalar$"), "layer_output_scale.weight"),
    (re.compile(r"\.experts\.gate_up_proj$"), "ffn_gate_up_exps.weight"),
    (re.compile(r"\.experts\.down_proj$"), "ffn_down_exps.weight"),
)


def write_gemma4_gguf(
    path: Path, model: Any, types: dict[str, gguf.GGMLQuantizationType] | None = None,
    tokenizer_from: Path | None = None, token_list: list[str] | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """``model``'s text model as a ``gemma4`` GGUF at ``path``, 2-D weights of a kind in ``types``
    quantized, the rest F32. Returns the state dict (``model``'s names) as the file holds it."""
    cfg = model.config.get_text_config()
    writer = gguf.GGUFWriter(str(path), "gemma4")
    _metadata(writer, cfg)
    if tokenizer_from is not None:
        copy_tokenizer(writer, tokenizer_from)
    if token_list is not None:  # the vocabulary alone, as a multimodal file's media ids need it
        writer.add_token_list(token_list)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, cfg.num_hidden_layers)
    held: dict[str, torch.Tensor] = {}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for key, tensor in model.state_dict().items():
        name = _TEXT_PREFIX.sub("model.", key)
        if _TOWERS.match(name) or (tied and name == "lm_head.weight"):
            continue
        gguf_name = _gguf_name(name, names)
        data = tensor.float().numpy().reshape(-1) if name.endswith("layer_scalar") else tensor.float().numpy()
        kind = gguf_name.split(".")[-2]
        qtype = types.get(kind) if types and data.ndim in (2, 3) else None  # 3: stacked experts
        written = _add_tensor(writer, gguf_name, data, qtype)
        held[key] = torch.from_numpy(np.ascontiguousarray(written)).reshape(tensor.shape).to(tensor.dtype)
    writer.add_tensor("rope_freqs.weight", _rope_freqs(cfg))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def _gguf_name(name: str, names: gguf.TensorNameMap) -> str:
    layer = re.match(r"^model\.layers\.(\d+)\.", name)
    for pattern, tail in _RENAMES:
        if pattern.search(name):
            assert layer is not None, name
            return f"blk.{layer.group(1)}.{tail}"
    stem, _, suffix = name.rpartition(".")
    mapped = names.get_name(stem)
    assert mapped is not None, f"gguf names no {stem}"
    return f"{mapped}.{suffix}"


def _metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    layers, types = cfg.num_hidden_layers, cfg.layer_types
    full = [cfg.per_layer_config[i] for i in range(layers) if types[i] == "full_attention"][0]
    swa = [cfg.per_layer_config[i] for i in range(layers) if types[i] == "sliding_attention"][0]
    shared = cfg.num_kv_shared_layers
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(layers)
    widths = [cfg.intermediate_size * (2 if cfg.use_double_wide_mlp and i >= layers - shared else 1)
              for i in range(layers)]  # fmt: skip
    writer.add_feed_forward_length(widths if cfg.use_double_wide_mlp else cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv([cfg.per_layer_config[i].num_key_value_heads for i in range(layers)])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input or 0)
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    writer.add_key_length(full.head_dim)
    writer.add_value_length(full.head_dim)
    writer.add_key_length_swa(swa.head_dim)
    writer.add_value_length_swa(swa.head_dim)
    writer.add_rope_dimension_count(full.head_dim)
    writer.add_rope_dimension_count_swa(swa.head_dim)
    if cfg.enable_moe_block:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.top_k_experts)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def _rope_freqs(cfg: Any) -> np.ndarray:
    """The converter's factors for the global layers' proportional rope."""
    head_dim = [
        cfg.per_layer_config[i].head_dim for i, t in enumerate(cfg.layer_types) if t == "full_attention"
    ][0]
    rotated = int(head_dim * cfg.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    return np.array([1.0] * rotated + [1e30] * (head_dim // 2 - rotated), dtype=np.float32)
