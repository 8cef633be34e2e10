"""Tiny hybrid models (tests/hybrid_models.py) written as GGUF files the way llama.cpp's converter
writes ``qwen35``, ``qwen35moe`` and ``qwen3next``: names from the ``gguf`` package's own map, and the
converter's changes made as it makes them (A_log stored as -exp(A_log), dt_bias as ``ssm_dt.bias``,
the conv1d weight squeezed, norms but the gated one as 1 + w, Qwen3-Next's in_proj_qkvz split into
q/k/v and z, Qwen3.5's value heads reordered from grouped by key head to tiled)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from tests.gguf_writer import _add_tensor, _join_experts, _split_experts

ARCH = {
    "qwen3_5": "qwen35",
    "qwen3_5_text": "qwen35",
    "qwen3_5_moe_text": "qwen35moe",
    "qwen3_next": "qwen3next",
}


def write_hybrid_gguf(path: Path, model: Any) -> dict[str, torch.Tensor]:
    """``model``'s language model as a GGUF at ``path`` (F32); returns its state dict as the file holds
    it (load it into ``model`` to make it the file's exact reference)."""
    cfg = model.config.get_text_config()
    arch = ARCH[model.config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, arch, cfg)
    model_arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)
    held: dict[str, torch.Tensor] = {}
    for key, tensor in _split_experts(model.state_dict()).items():
        name = key.replace("model.language_model.", "model.")
        if name.startswith("model.visual.") or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue
        for hf, data in _converted(arch, cfg, name, tensor.double().numpy()):
            stem, _, suffix = hf.rpartition(".")
            gguf_name = names.get_name(stem) if suffix in ("weight", "bias") else names.get_name(hf)
            assert gguf_name is not None, hf
            if suffix in ("weight", "bias"):
                gguf_name = f"{gguf_name}.{suffix}"
            _add_tensor(writer, gguf_name, data.astype(np.float32), None)
        held[key] = _as_held(name, tensor)
    _join_experts(held)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def _as_held(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The HF tensor as the loader reads it back from the F32 file."""
    value = tensor.float()
    if name.endswith(".A_log"):
        return torch.log(-(-torch.exp(tensor)).float().double()).float().to(tensor.dtype)
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        value = (value + 1.0) - 1.0
    return value.to(tensor.dtype)


def _converted(arch: str, cfg: Any, name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """What the converter writes for HF tensor ``name``: (its HF-style name, data) pairs."""
    if name.endswith(".A_log"):
        data = -np.exp(data)
    elif name.endswith(".dt_bias"):
        name = name.replace(".dt_bias", ".dt_proj.bias")
    elif "conv1d" in name:
        data = data.squeeze(1)
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        data = data + 1.0
    if "linear_attn." in name and arch != "qwen3next":
        data = _tiled(cfg, name, data)
    if name.endswith("in_proj_qkvz.weight"):
        return _split_qkvz(cfg, name, data)
    return [(name.removesuffix(".A_log") + ".A_log" if name.endswith(".A_log") else name, data)]


def _split_qkvz(cfg: Any, name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    hk, per = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    grouped = data.reshape(hk, 2 * dk + 2 * per * dv, -1)
    q, k, v, z = np.split(grouped, np.cumsum([dk, dk, per * dv])[:3], axis=1)
    qkv = np.concatenate([part.reshape(-1, data.shape[1]) for part in (q, k, v)])
    prefix = name.removesuffix("in_proj_qkvz.weight")
    return [(f"{prefix}in_proj_qkv.weight", qkv), (f"{prefix}in_proj_z.weight", z.reshape(-1, data.shape[1]))]


def _tiled(cfg: Any, name: str, data: np.ndarray) -> np.ndarray:
    """Qwen3.5's value heads from grouped by key head to tiled (value head h reads key head h % H_k)."""
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)  # fmt: skip
    if hk == hv:
        return data

    def tile(x: np.ndarray, axis: int, dim: int) -> np.ndarray:
        x = np.moveaxis(x, axis, 0)
        shape = x.shape
        x = x.reshape(hk, hv // hk, dim, *shape[1:]).swapaxes(0, 1).reshape(shape)
        return np.moveaxis(x, 0, axis)

    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        head = 2 * hk * dk
        return np.concatenate([data[:head], tile(data[head:], 0, dv)])
    if name.endswith("in_proj_z.weight"):
        return tile(data, 0, dv)
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", ".A_log", "dt_proj.bias")):
        return tile(data, 0, 1)
    if name.endswith("out_proj.weight"):
        return tile(data, 1, dv)
    return data


def _metadata(writer: gguf.GGUFWriter, arch: str, cfg: Any) -> None:
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    if getattr(cfg, "intermediate_size", None):
        writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(cfg.linear_key_head_dim)
    writer.add_ssm_group_count(cfg.linear_num_key_heads)
    writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    writer.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    kinds = list(getattr(cfg, "layer_types", None) or [])
    writer.add_full_attention_interval(kinds.index("full_attention") + 1 if "full_attention" in kinds else 4)
    sections = list(cfg.rope_parameters.get("mrope_section") or [])
    if sections:  # as llama.cpp's converter writes Qwen's (t, h, w): padded with zeros to four
        writer.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if arch != "qwen35":
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
