"""Tiny HF models written as GGUF files the way llama.cpp's converter (convert_hf_to_gguf.py) writes them.

Names come from the ``gguf`` package's own HF -> GGUF name map (not from the loader under test), and
the converter's changes are made as it makes them: Llama's Q/K rows permuted per head, Gemma's norms
stored as 1 + w, Phi-3's fused projections kept, Llama 3's rope scaling as a ``rope_freqs`` tensor,
LongRoPE's factors as ``rope_factors_long/short``, GPT-2's Conv1D weights transposed to [out, in] and
its tied head written again as ``output``. tests/gpu_worker/test_families.py checks that
transformers' own GGUF loader reads these files back as the HF model they came from.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
        "gemma3_text": "gemma3", "gemma3": "gemma3", "phi3": "phi3", "qwen3_moe": "qwen3moe",
        "mixtral": "llama", "gpt2": "gpt2"}  # fmt: skip
# A multimodal checkpoint's language model, in transformers' module names.
_TEXT_PREFIX = re.compile(r"^model\.language_model\.")
_VISION = re.compile(r"^model\.(vision_tower|multi_modal_projector)\.")
_CONV1D = re.compile(r"\.(c_attn|c_proj|c_fc)\.weight$")  # GPT-2's [in, out] weights


def llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama's Q/K rows (pairs rotary dims i and i + D/2)."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def write_gguf(
    path: Path,
    model: Any,
    types: dict[str, gguf.GGMLQuantizationType] | None = None,
    tokenizer_from: Path | None = None,
) -> dict[str, torch.Tensor]:
    """``model``'s text model as a GGUF at ``path``, 2-D weights of a kind in ``types`` (``attn_q``,
    ``ffn_down``, ...) quantized, the rest F32; the ``tokenizer.*`` fields of ``tokenizer_from``'s
    GGUF (for a model of its vocabulary that a launcher serves). Returns the state dict (``model``'s
    own names) as the file holds it: load it into ``model`` to make it the file's exact reference."""
    cfg = model.config.get_text_config()
    arch = ARCH[model.config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, arch, cfg)
    if tokenizer_from is not None:
        copy_tokenizer(writer, tokenizer_from)
    model_arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)
    held: dict[str, torch.Tensor] = {}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for key, tensor in _split_experts(model.state_dict()).items():
        name = _TEXT_PREFIX.sub("model.", key)
        if _VISION.match(name) or (tied and name == "lm_head.weight"):
            continue  # the vision tower; a tied head (the file holds the embedding once)
        stem, _, suffix = name.rpartition(".")
        gguf_name = f"{names.get_name(stem)}.{suffix}"
        data = tensor.float().numpy()
        if arch == "gpt2" and _CONV1D.search(name):  # the converter's transpose; undone below
            data = np.ascontiguousarray(data.T)
        heads = _permuted_heads(arch, gguf_name, cfg)
        if heads:
            data = llama_cpp_permute(data, heads)
        if arch.startswith("gemma") and "norm." in gguf_name:
            data = data + np.float32(1.0)
        kind = gguf_name.split(".")[-2]
        qtype = types.get(kind) if types and data.ndim in (2, 3) else None  # 3: stacked experts
        written = _add_tensor(writer, gguf_name, data, qtype)
        if arch == "gpt2" and gguf_name == "token_embd.weight":  # the converter's copy as the head
            _add_tensor(writer, "output.weight", data, qtype)
        data = written
        if heads:
            data = llama_cpp_permute_inverse(data, heads)
        if arch.startswith("gemma") and "norm." in gguf_name:
            data = data - np.float32(1.0)
        if arch == "gpt2" and _CONV1D.search(name):
            data = data.T
        held[key] = torch.from_numpy(np.array(data, dtype=np.float32)).to(tensor.dtype)
    _rope_tensors(writer, arch, cfg)
    _join_experts(held)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def _add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: Any) -> np.ndarray:
    """``data`` written as ``name``, in ``qtype``'s blocks (None: F32); returns the values it holds."""
    if qtype is None:
        writer.add_tensor(name, data)
        return data
    blocks = gguf.quants.quantize(data, qtype)
    writer.add_tensor(name, blocks, raw_dtype=qtype)
    return np.asarray(gguf.quants.dequantize(blocks, qtype))


_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def _split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) as the converter
    names them: ``experts.gate_proj`` / ``up_proj`` / ``down_proj`` [E, rows, cols] each."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        match = _STACKED.match(key)
        if match is None:
            out[key] = tensor
        elif match.group(2) == "down_proj":
            out[f"{match.group(1)}.down_proj.weight"] = tensor
        else:
            gate, up = tensor.chunk(2, dim=1)
            out[f"{match.group(1)}.gate_proj.weight"], out[f"{match.group(1)}.up_proj.weight"] = gate, up
    return out


def _join_experts(held: dict[str, torch.Tensor]) -> None:
    """``_split_experts`` undone on the tensors as written (transformers' state dict names)."""
    for key in [k for k in held if k.endswith(".experts.gate_proj.weight")]:
        prefix = key.removesuffix(".gate_proj.weight")
        gate, up = held.pop(key), held.pop(f"{prefix}.up_proj.weight")
        held[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        held[f"{prefix}.down_proj"] = held.pop(f"{prefix}.down_proj.weight")


def copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> None:
    """Every ``tokenizer.*`` field of ``source`` (bench/lib/gguf_models.py does the same)."""
    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") and not key.endswith(
            ("bos_token_id", "eos_token_id", "padding_token_id")
        ):
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)


def llama_cpp_permute_inverse(rows: np.ndarray, heads: int) -> np.ndarray:
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _permuted_heads(arch: str, gguf_name: str, cfg: Any) -> int:
    if arch != "llama":
        return 0
    if ".attn_q." in gguf_name:
        return int(cfg.num_attention_heads)
    if ".attn_k." in gguf_name:
        return int(cfg.num_key_value_heads)
    return 0


def _gpt2_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """convert_hf_to_gguf.py's GPT2Model.set_gguf_parameters (its context length is n_ctx, which
    transformers' GPT2Config names n_positions), and the token ids its vocabulary step writes."""
    writer.add_block_count(cfg.n_layer)
    writer.add_context_length(cfg.n_positions)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_feed_forward_length(4 * cfg.n_embd)
    writer.add_head_count(cfg.n_head)
    writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)


def _metadata(writer: gguf.GGUFWriter, arch: str, cfg: Any) -> None:
    if arch == "gpt2":
        _gpt2_metadata(writer, cfg)
        return
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if getattr(cfg, "pad_token_id", None) is not None:
        writer.add_pad_token_id(cfg.pad_token_id)
    _expert_metadata(writer, cfg)
    rope = cfg.rope_parameters
    if arch == "gemma3":
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        if rope["full_attention"].get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
    if arch in ("gemma2", "gemma3", "qwen3") or head_dim != cfg.hidden_size // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if arch in ("gemma2", "gemma3", "phi3") and getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    if arch in ("gemma2", "gemma3") and cfg.query_pre_attn_scalar != head_dim:
        writer.add_attention_scale(cfg.query_pre_attn_scalar**-0.5)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch != "gemma3" and rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        original = rope["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        )
        writer.add_rope_scaling_orig_ctx_len(original)


def _expert_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """What the converter writes of a mixture of experts (Mixtral's and Qwen3-MoE's)."""
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if not experts:
        return
    writer.add_expert_count(experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if cfg.model_type == "qwen3_moe":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_weights_norm(cfg.norm_topk_prob)


def _rope_tensors(writer: gguf.GGUFWriter, arch: str, cfg: Any) -> None:
    rope = getattr(cfg, "rope_parameters", None) or {}  # GPT-2: none
    if arch == "llama" and rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_factors(cfg))
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _llama3_factors(cfg: Any) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, as it computes them."""
    rope = cfg.rope_parameters
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)
