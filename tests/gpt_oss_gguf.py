"""A tiny HF gpt-oss written as a GGUF the way llama.cpp's converter writes one (``gpt-oss``: gate and
up split out of HF's interleaved ``gate_up_proj``, each expert projection stacked [experts, out, in],
the experts in MXFP4, the sinks as ``attn_sinks.weight``, the router as ``ffn_gate_inp``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from tests.gguf_writer import copy_tokenizer

Q = gguf.GGMLQuantizationType
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    **{f"self_attn.{p}_proj.{k}": f"attn_{q}.{k}" for p, q in
       (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")) for k in ("weight", "bias")},
}  # fmt: skip


def gpt_oss_tensors(state: dict[str, torch.Tensor], layers: int) -> dict[str, np.ndarray]:
    """GGUF name -> float32 values of an HF gpt-oss state dict, as the converter lays them out."""
    out = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output_norm.weight": state["model.norm.weight"],
        "output.weight": state["lm_head.weight"],
    }
    for i in range(layers):
        at = f"model.layers.{i}."
        out |= {f"blk.{i}.{g}": state[at + h] for h, g in _LAYER.items()}
        gate_up, bias = state[at + "mlp.experts.gate_up_proj"], state[at + "mlp.experts.gate_up_proj_bias"]
        out[f"blk.{i}.ffn_gate_exps.weight"] = gate_up[:, :, 0::2].transpose(1, 2)
        out[f"blk.{i}.ffn_up_exps.weight"] = gate_up[:, :, 1::2].transpose(1, 2)
        out[f"blk.{i}.ffn_down_exps.weight"] = state[at + "mlp.experts.down_proj"].transpose(1, 2)
        out[f"blk.{i}.ffn_gate_exps.bias"], out[f"blk.{i}.ffn_up_exps.bias"] = bias[:, 0::2], bias[:, 1::2]
        out[f"blk.{i}.ffn_down_exps.bias"] = state[at + "mlp.experts.down_proj_bias"]
    return {name: np.ascontiguousarray(t.float().numpy()) for name, t in out.items()}


def write_gpt_oss_gguf(
    path: Path, model: Any, experts: Q = Q.MXFP4, tokenizer_from: Path | None = None, head: Q = Q.F32
) -> None:
    """``model`` as a GGUF at ``path``, its expert weights in ``experts``' blocks, the LM head in
    ``head``'s (the bench file's: BF16), the rest F32; the model's weights are then set to the values
    the file holds (the file's exact reference)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    gpt_oss_metadata(writer, cfg)
    if tokenizer_from is not None:
        copy_tokenizer(writer, tokenizer_from)
    held: dict[str, np.ndarray] = {}
    for name, data in gpt_oss_tensors(model.state_dict(), cfg.num_hidden_layers).items():
        if name.endswith("_exps.weight") and experts != Q.F32:
            blocks = gguf.quants.quantize(data, experts)
            writer.add_tensor(name, blocks, raw_dtype=experts)
            held[name] = np.asarray(gguf.quants.dequantize(blocks, experts))
        elif name == "output.weight" and head != Q.F32:
            blocks = gguf.quants.quantize(data, head)
            writer.add_tensor(name, blocks, raw_dtype=head)
            held[name] = np.asarray(gguf.quants.dequantize(blocks, head))
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with torch.no_grad():
        for param in model.parameters():  # F32 in the file
            param.copy_(param.float())
        if "output.weight" in held:
            model.lm_head.weight.copy_(torch.from_numpy(held["output.weight"]).to(model.lm_head.weight.dtype))
        for i in range(cfg.num_hidden_layers):
            if f"blk.{i}.ffn_gate_exps.weight" not in held:
                continue
            mlp = model.model.layers[i].mlp.experts
            gate, up = (torch.from_numpy(held[f"blk.{i}.ffn_{p}_exps.weight"]) for p in ("gate", "up"))
            mlp.gate_up_proj[:, :, 0::2] = gate.transpose(1, 2).to(mlp.gate_up_proj.dtype)
            mlp.gate_up_proj[:, :, 1::2] = up.transpose(1, 2).to(mlp.gate_up_proj.dtype)
            down = torch.from_numpy(held[f"blk.{i}.ffn_down_exps.weight"])
            mlp.down_proj.copy_(down.transpose(1, 2).to(mlp.down_proj.dtype))


def gpt_oss_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """The ``gpt-oss.*`` keys llama.cpp's converter writes from an HF config."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.intermediate_size)
    writer.add_sliding_window(cfg.sliding_window)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if cfg.bos_token_id is not None:
        writer.add_bos_token_id(cfg.bos_token_id)
    if cfg.eos_token_id is not None:
        writer.add_eos_token_id(cfg.eos_token_id)


def hf_mxfp4(values: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """``values`` [E, rows, k] as an HF checkpoint's MXFP4 ``blocks`` [E, rows, k / 32, 16] and
    ``scales`` [E, rows, k / 32] (gguf-py's quantization, HF's nibble order), and the values they hold."""
    e, rows, k = values.shape
    ggml = gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), Q.MXFP4).reshape(
        e, rows, k // 32, 17
    )
    held = np.asarray(gguf.quants.dequantize(ggml.reshape(e * rows, -1), Q.MXFP4)).reshape(e, rows, k)
    nibbles = np.concatenate((ggml[..., 1:] & 0x0F, ggml[..., 1:] >> 4), axis=-1)  # value order
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(ggml[..., 0].copy()), held
