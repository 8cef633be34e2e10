"""Hybrid models' GGUF files (``qwen35``, ``qwen35moe``, ``qwen3next``): their tensor names, the
converter's changes undone, and their config.

llama.cpp's converter (convert_hf_to_gguf.py, its Qwen3Next model and the Qwen3.5 models built on it)
changes the linear-attention layers' tensors:
- ``A_log`` is stored as ``ssm_a`` = -exp(A_log) (read back as log(-a), taken in float64, kept as
  float32 as the file's tensors are);
- ``dt_bias`` becomes ``ssm_dt.bias``; the conv1d weight [C, 1, K] is squeezed to [C, K];
- every RMSNorm weight but the gated norm's (``ssm_norm``) is stored as 1 + w;
- Qwen3-Next's fused ``in_proj_qkvz`` is split into ``attn_qkv`` (q, k, v each over all heads, as
  Qwen3.5's ``in_proj_qkv``) and ``attn_gate`` (z); its ``in_proj_ba`` stays grouped per key head
  (``ssm_ba``): the model's ``split_ba`` layout;
- Qwen3.5's files, where key heads are fewer than value heads, have every value-head tensor (v's rows
  of ``attn_qkv`` and its conv channels, z, b, a, A, dt, ``ssm_out``'s columns) reordered so value head
  h reads key head h % H_k: the model computes in that order (``linear_value_heads_tiled``), which
  leaves every quantized block as it lies.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

HYBRID_ARCHITECTURES = ("qwen35", "qwen35moe", "qwen3next")
LINEAR = "linear_attention"
_MODEL_TYPES = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next"}
HYBRID_TENSORS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
# Tensors the converter names without the .weight suffix, or renames with their kind.
_WHOLE = re.compile(r"blk\.(\d+)\.(ssm_a|ssm_dt\.bias)$")
_WHOLE_NAMES = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}


def hybrid_whole_name(gguf_name: str) -> str | None:
    """The HF name of a tensor named whole (``blk.N.ssm_a``, ``blk.N.ssm_dt.bias``), else None."""
    match = _WHOLE.match(gguf_name)
    return None if match is None else f"model.layers.{match.group(1)}.{_WHOLE_NAMES[match.group(2)]}"


def hybrid_tensor(name: str, data: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, tuple[int, ...]]:
    """Undo the converter's change of tensor ``name`` (module docstring): its data and HF shape."""
    if name.endswith(".A_log"):
        return np.log(-data.astype(np.float64)).astype(np.float32), shape
    if name.endswith("linear_attn.conv1d.weight"):
        return data, (shape[0], 1, shape[-1])
    if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
        return data, (1, shape[0])
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return data.astype(np.float32) - np.float32(1.0), shape
    return data, shape


def hybrid_config(arch: str, config: dict[str, Any], key: Any) -> dict[str, Any]:
    """``config`` (gguf_config's common decoder fields) completed for a hybrid architecture;
    ``key(name, default)`` reads ``<arch>.<name>``."""
    value_heads = int(key("ssm.time_step_rank"))
    # A converter run with MTP counts its multi-token-prediction layer in block_count: not served (the
    # loader drops the tensors of layers past num_hidden_layers).
    layers = config["num_hidden_layers"] - int(key("nextn_predict_layers", 0))
    interval = int(key("full_attention_interval", 4))
    config |= {
        "model_type": _MODEL_TYPES[arch], "hidden_act": "silu", "num_hidden_layers": layers,
        "linear_conv_kernel_dim": int(key("ssm.conv_kernel")),
        "linear_key_head_dim": int(key("ssm.state_size")),
        "linear_num_key_heads": int(key("ssm.group_count")), "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(key("ssm.inner_size")) // value_heads,
        "layer_types": [LINEAR if (i + 1) % interval else "full_attention" for i in range(layers)],
    }  # fmt: skip
    config.pop("sliding_window", None)
    rotary = int(key("rope.dimension_count", config["head_dim"]))
    config["rope_parameters"]["partial_rotary_factor"] = rotary / config["head_dim"]
    sections = [int(s) for s in key("rope.dimension_sections", None) or []]
    if arch != "qwen3next" and any(sections):
        # Qwen3.5's 3D rope for image tokens: the converter pads its (t, h, w) sections with zeros.
        config["rope_parameters"] |= {"mrope_section": sections[:3], "mrope_interleaved": True}
    if arch == "qwen3next":
        config["gguf_linear_layout"] = "split_ba"
    elif config["linear_num_key_heads"] < value_heads:
        config["linear_value_heads_tiled"] = True
    if arch != "qwen35":
        config |= {
            "num_experts": int(key("expert_count")), "num_experts_per_tok": int(key("expert_used_count")),
            "moe_intermediate_size": int(key("expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(key("expert_shared_feed_forward_length")),
            "norm_topk_prob": bool(key("expert_weights_norm", True)), "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }  # fmt: skip
    return config
