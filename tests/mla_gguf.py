"""Tiny latent-attention HF models written as ``deepseek2`` GGUFs the way llama.cpp's converter writes
them (its DeepseekV2Model: MQA metadata over the latent, stacked experts, the score-correction bias as
``exp_probs_b.bias``), with kv_b split into ``attn_k_b`` (transposed per head) / ``attn_v_b`` as newer
converters do, or whole as older ones did (``split_kv_b``). Names come from the ``gguf`` package's
own map."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from tests.gguf_writer import _add_tensor, _join_experts, _split_experts


def write_mla_gguf(
    path: Path,
    model: Any,
    split_kv_b: bool = True,
    types: dict[str, gguf.GGMLQuantizationType] | None = None,
    mtp: bool = False,
) -> dict[str, torch.Tensor]:
    """``model`` as a deepseek2 GGUF; 2-D weights of a kind in ``types`` quantized; ``mtp``: one
    multi-token-prediction layer after the model's, as GLM-4.7-Flash's converter keeps it (random,
    never read). Returns the state dict as the file holds it (load it into ``model`` to make it the
    file's exact reference)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    _metadata(writer, cfg, split_kv_b, mtp)
    if mtp:
        _mtp_layer(writer, cfg)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, cfg.num_hidden_layers)
    held: dict[str, torch.Tensor] = {}
    for key, tensor in _split_experts(model.state_dict()).items():
        data = tensor.float().numpy()
        if key.endswith("kv_b_proj.weight") and split_kv_b:
            held[key] = _split_kv_b(writer, names, key, data, cfg, types or {}).to(tensor.dtype)
            continue
        stem, _, suffix = key.rpartition(".")
        if suffix == "e_score_correction_bias":
            stem, suffix = f"{stem}.e_score_correction", "bias"
        gguf_name = f"{names.get_name(stem)}.{suffix}"
        qtype = (types or {}).get(gguf_name.split(".")[-2]) if data.ndim in (2, 3) else None
        written = _add_tensor(writer, gguf_name, data, qtype)
        held[key] = torch.from_numpy(np.array(written, dtype=np.float32)).to(tensor.dtype)
    _join_experts(held)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def _split_kv_b(
    writer: gguf.GGUFWriter, names: Any, key: str, data: np.ndarray, cfg: Any, types: dict[str, Any]
) -> torch.Tensor:
    """kv_b as attn_k_b [H, r, nope] and attn_v_b [H, v, r] (in ``types``' blocks where named); returns
    kv_b [H (nope + v), r] as the file holds it."""
    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    kv_b = data.reshape(heads, nope + v, -1)
    k_b, v_b = np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)), np.ascontiguousarray(kv_b[:, nope:])
    stem = key.removesuffix(".weight")
    k_name, v_name = (names.get_name(stem.replace("kv_b_proj", part)) for part in ("k_b_proj", "v_b_proj"))
    k_b = _add_tensor(writer, f"{k_name}.weight", k_b, types.get("attn_k_b")).reshape(k_b.shape)
    v_b = _add_tensor(writer, f"{v_name}.weight", v_b, types.get("attn_v_b")).reshape(v_b.shape)
    joined = np.concatenate((k_b.transpose(0, 2, 1), v_b), axis=1).astype(np.float32)
    return torch.from_numpy(joined.reshape(data.shape))


def _mtp_layer(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """A few of a multi-token-prediction layer's tensors: its own (``nextn.*``) and ordinary ones."""
    rng, h, i = np.random.default_rng(0), cfg.hidden_size, cfg.num_hidden_layers
    tensors = {"nextn.eh_proj": (h, 2 * h), "nextn.enorm": (h,), "attn_norm": (h,), "ffn_gate_inp": (8, h)}
    for name, dims in tensors.items():
        writer.add_tensor(f"blk.{i}.{name}.weight", rng.normal(size=dims).astype(np.float32))


def _metadata(writer: gguf.GGUFWriter, cfg: Any, split_kv_b: bool, mtp: bool) -> None:
    """convert_hf_to_gguf.py's DeepseekV2Model.set_gguf_parameters, for these configs."""
    rank, rope, nope, v = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers + int(mtp))
    if mtp:
        writer.add_nextn_predict_layers(1)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(1)  # the converter's MQA over the latent
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    types = getattr(cfg, "mlp_layer_types", None)
    dense = types.index("sparse") if types else cfg.first_k_dense_replace
    writer.add_leading_dense_block_count(dense)
    if cfg.q_lora_rank is not None:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(rank)
    if split_kv_b:  # newer converters: the latent's lengths, the heads' in *_mla
        writer.add_key_length(rank + rope)
        writer.add_value_length(rank)
        writer.add_key_length_mla(nope + rope)
        writer.add_value_length_mla(v)
    else:
        writer.add_key_length(nope + rope)
        writer.add_value_length(v)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    v3 = cfg.model_type != "deepseek_v2"
    if v3 and cfg.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    if getattr(cfg, "n_group", None) is not None:
        writer.add_expert_group_count(cfg.n_group)
        writer.add_expert_group_used_count(cfg.topk_group)
    if v3:  # a real V3 / GLM config's scoring_func
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_rope_dimension_count(rope)
    params = cfg.rope_parameters
    writer.add_rope_freq_base(params["rope_theta"])
    if params.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(params["factor"])
        writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])
