"""GGUF tensor names -> the checkpoint (HF) names our models load, per architecture.

Per architecture (``LAYER_TENSORS``), llama.cpp's converter names the tensors its own way and changes
some of them, undone by the loader (gguf_weights.py) as transformers' own GGUF loader undoes them:
- Llama: each head's Q and K rows permuted (rotary dimensions i and i + D/2 paired as neighbours).
  Quantization blocks run along a row (the input dimension), so undoing the permutation by whole
  output rows keeps every block intact: the rows end up in HF's order, bit for bit the blocks they were.
- Gemma 2/3: every RMSNorm weight stored as 1 + w (HF's Gemma norms multiply by 1 + w): 1 is
  subtracted in float32, as transformers does.
- Phi-3: q/k/v and gate/up stay fused as HF's checkpoint holds them (``MergedLinear.fused_checkpoint``).
- GPT-2: the converter transposes HF's Conv1D weights to [out, in], as our Linears hold them; its
  tensors sit under ``transformer.`` (``transformer.h.N``, ``wte``, ``wpe``, ``ln_f``).
- Gemma 4: norms as they are (HF's multiply by w); the router's scales, the layer scalar and the
  stacked experts under whole names of their own (gguf_gemma4.py).
Qwen2/3 files hold HF's tensors as they are.
"""

from __future__ import annotations

import re

import numpy as np

from gpu_worker.weights.gguf_gemma4 import GEMMA4_GLOBALS, GEMMA4_TENSORS
from gpu_worker.weights.gguf_gpt_oss import GPT_OSS_TENSORS
from gpu_worker.weights.gguf_hybrid import HYBRID_ARCHITECTURES, HYBRID_TENSORS, hybrid_whole_name

_COMMON_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# A sparse layer's router and stacked experts ([experts, rows, cols] each): one tensor per projection,
# which names no expert (``STACKED``); the checkpoint names one per expert (``experts.{e}.gate_proj``).
_MOE = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
STACKED = re.compile(r"^(.*\.experts)\.(gate_proj|up_proj|down_proj)\.weight$")
_LLAMA = {**_COMMON_LAYER, "ffn_norm": "post_attention_layernorm", **_MOE}  # Mixtral's files are llama's
_GEMMA = {
    **_COMMON_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Latent attention (DeepSeek-V2/V3, GLM-4.7-Flash). Newer files split kv_b into attn_k_b / attn_v_b,
# which the loader joins back (gguf_mla.py); a router's score-correction bias is exp_probs_b.bias.
_DEEPSEEK2 = {
    **_LLAMA,
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# Per GGUF architecture: the layer tensors' HF names. Phi-3's file keeps HF's fused projections
# (attn_qkv, and ffn_up holding gate and up, gate first as HF's gate_up_proj).
LAYER_TENSORS = {
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": {**_LLAMA, **_QK_NORMS},
    "qwen3moe": {**_LLAMA, **_QK_NORMS},
    "gemma2": _GEMMA,
    "gemma3": {**_GEMMA, **_QK_NORMS},
    "gemma4": GEMMA4_TENSORS,  # gguf_gemma4.py
    "phi3": {
        "attn_norm": "input_layernorm",
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_up": "mlp.gate_up_proj",
        "ffn_down": "mlp.down_proj",
    },
    "deepseek2": _DEEPSEEK2,
    "gpt2": {
        "attn_norm": "ln_1",
        "attn_qkv": "attn.c_attn",
        "attn_output": "attn.c_proj",
        "ffn_norm": "ln_2",
        "ffn_up": "mlp.c_fc",
        "ffn_down": "mlp.c_proj",
    },
}
LAYER_TENSORS |= {arch: HYBRID_TENSORS for arch in HYBRID_ARCHITECTURES}  # Qwen3.5, Qwen3-Next
LAYER_TENSORS["gpt-oss"] = GPT_OSS_TENSORS  # gguf_gpt_oss.py
ARCHITECTURES = tuple(LAYER_TENSORS)
PERMUTED_QK = ("llama",)  # the converter permutes these architectures' Q/K rows
NORMS_PLUS_ONE = ("gemma2", "gemma3")  # the converter stores Gemma's norms as 1 + w
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Where an architecture's checkpoint puts its layers and global tensors, where not as Llama's.
_LAYERS_AT = {"gpt2": "transformer.h"}
_GLOBALS = {
    "gpt2": {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
             "output_norm": "transformer.ln_f", "output": "lm_head"},
    "gemma4": GEMMA4_GLOBALS,
}  # fmt: skip
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias|scale)$")
# Rope factors: gguf_config.py reads them into the config.
_IGNORED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# A multi-token-prediction layer's own tensors (GLM-4.7-Flash's files keep it): not served
# (its ordinary ones the latent loader drops by their layer number: gguf_mla.py).
_NEXTN = re.compile(r"blk\.\d+\.nextn\.")


class GgufError(ValueError):
    """The GGUF cannot be loaded in quantized form (its architecture, or its tensors)."""


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The checkpoint (HF) name of a GGUF tensor of ``arch``; None for tensors we do not load."""
    if gguf_name in _IGNORED or _NEXTN.match(gguf_name):
        return None
    layer_tensors = LAYER_TENSORS[arch]
    whole_hybrid = hybrid_whole_name(gguf_name) if arch in HYBRID_ARCHITECTURES else None
    if whole_hybrid is not None:
        return whole_hybrid
    match = _LAYER_NAME.match(gguf_name)
    if match:
        layer, tensor, kind = match.groups()
        whole = layer_tensors.get(f"{tensor}.{kind}")  # a tensor named in full (not name.weight)
        if whole is not None:
            return f"{_LAYERS_AT.get(arch, 'model.layers')}.{layer}.{whole}"
        if tensor not in layer_tensors:
            raise GgufError(f"GGUF tensor {gguf_name} has no place in a {arch} model")
        return f"{_LAYERS_AT.get(arch, 'model.layers')}.{layer}.{layer_tensors[tensor]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    global_tensors = _GLOBALS.get(arch, _GLOBAL_TENSORS)
    if stem not in global_tensors:
        raise GgufError(f"GGUF tensor {gguf_name} has no place in a {arch} model")
    return f"{global_tensors[stem]}.{kind}"


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head rotary permutation of Q/K rows (whole rows move, blocks stay)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
