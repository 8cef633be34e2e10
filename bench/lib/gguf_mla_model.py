"""A DeepSeek-V2-Lite-shaped GGUF for the latent-attention benches (bench/lib/gguf_models.py's kind:
random blocks, SmolLM2's tokenizer padded to the vocabulary; ``deepseekv2lite-q4_k_m``).

DeepSeek-V2-Lite's config (architecture ``deepseek2`` as llama.cpp's converter writes it): hidden 2048,
16 heads with no q_lora_rank (``attn_q`` straight from the hidden state), a latent of 512 and a rope
key of 64 (``attn_kv_a_mqa`` [576, hidden], its norm), keys of 128 + 64 and values of 128 a head from
kv_b, which newer converters store split (``attn_k_b`` [heads, 512, 128] per head transposed,
``attn_v_b`` [heads, 128, 512]); 64 routed experts of 1408 (6 a token, softmax scores, no
renormalisation) beside 2 shared ones (``ffn_*_shexp`` of 2816); its first layer dense (FFN 10944);
YaRN (factor 40 over 4096 positions, mscale 0.707). It has all 27 of its layers (llama.cpp tells a
model without q_lora_rank by 26 or 27 layers, so fewer would not load there) and its 163840-token
context. Types follow bench/lib/gguf_models.py's ``tensor_type`` (Q4_K_M: Q4_K, the down projections
Q6_K in the "more bits" layers, rows not whole super-blocks falling back); norms and the router F32.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from bench.lib.gguf_blocks import declare_tensors, random_blocks
from bench.lib.gguf_models import FILE_TYPES, WEIGHT_STD, Q, _copy_tokenizer, tensor_type
from gpu_worker.weights.model_files import cache_root, embedded_gguf_path

NAME = "deepseekv2lite"
VERSION = 2
Dims = tuple[int, ...]


@dataclass(frozen=True)
class MlaShape:
    """DeepSeek-V2-Lite's sizes (all 27 layers); a test writes it smaller with replace."""

    hidden: int = 2048
    layers: int = 27
    heads: int = 16
    vocab: int = 102400
    context: int = 163840  # 40 x 4096: YaRN's factor over the original length
    rank: int = 512  # kv_lora_rank
    rope: int = 64
    nope: int = 128
    v: int = 128
    experts: int = 64
    used: int = 6
    expert_ffn: int = 1408
    shared: int = 2
    dense_ffn: int = 10944


V2_LITE = MlaShape()


def _layer(shape: MlaShape, i: int) -> list[tuple[str, Dims]]:
    h, heads, rank = shape.hidden, shape.heads, shape.rank
    out: list[tuple[str, Dims]] = [
        ("attn_norm", (h,)), ("attn_q", (heads * (shape.nope + shape.rope), h)),
        ("attn_kv_a_mqa", (rank + shape.rope, h)), ("attn_kv_a_norm", (rank,)),
        ("attn_k_b", (heads, rank, shape.nope)), ("attn_v_b", (heads, shape.v, rank)),
        ("attn_output", (h, heads * shape.v)), ("ffn_norm", (h,)),
    ]  # fmt: skip
    if i == 0:  # first_k_dense_replace = 1
        f = shape.dense_ffn
        return out + [("ffn_gate", (f, h)), ("ffn_up", (f, h)), ("ffn_down", (h, f))]
    e, f, shared = shape.experts, shape.expert_ffn, shape.shared * shape.expert_ffn
    return out + [
        ("ffn_gate_inp", (e, h)), ("ffn_gate_exps", (e, f, h)), ("ffn_up_exps", (e, f, h)),
        ("ffn_down_exps", (e, h, f)), ("ffn_gate_shexp", (shared, h)), ("ffn_up_shexp", (shared, h)),
        ("ffn_down_shexp", (h, shared)),
    ]  # fmt: skip


def tensors(shape: MlaShape, file_type: str) -> list[tuple[str, Q | None, Dims]]:
    """(GGUF name, block type or None for F32, dims) of every tensor, in llama.cpp's order."""
    h, n = shape.hidden, shape.layers
    out: list[tuple[str, Q | None, Dims]] = [
        ("token_embd.weight", tensor_type(file_type, "token_embd", 0, n, cols=h), (shape.vocab, h))
    ]
    for i in range(n):
        for role, dims in _layer(shape, i):
            f32 = len(dims) == 1 or role == "ffn_gate_inp"
            more_bits_role = "ffn_down" if role.startswith("ffn_down") else role
            qtype = None if f32 else tensor_type(file_type, more_bits_role, i, n, dims[-1])
            out.append((f"blk.{i}.{role}.weight", qtype, dims))
    out.append(("output_norm.weight", None, (h,)))
    out.append(("output.weight", tensor_type(file_type, "output", 0, n, cols=h), (shape.vocab, h)))
    return out


def _metadata(writer: gguf.GGUFWriter, shape: MlaShape, file_type: str) -> None:
    """convert_hf_to_gguf.py's DeepseekV2Model.set_gguf_parameters for this config."""
    writer.add_name(f"{NAME}-shape {file_type} (random blocks, rivulet bench)")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.dense_ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(shape.vocab)
    writer.add_leading_dense_block_count(1)
    writer.add_kv_lora_rank(shape.rank)
    writer.add_key_length(shape.rank + shape.rope)
    writer.add_value_length(shape.rank)
    writer.add_key_length_mla(shape.nope + shape.rope)
    writer.add_value_length_mla(shape.v)
    writer.add_expert_feed_forward_length(shape.expert_ffn)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.used)
    writer.add_expert_shared_count(shape.shared)
    writer.add_expert_weights_scale(1.0)
    writer.add_rope_dimension_count(shape.rope)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(40.0)
    writer.add_rope_scaling_orig_ctx_len(4096)
    writer.add_rope_scaling_yarn_log_mul(0.1 * 0.707)
    writer.add_file_type(int(FILE_TYPES[file_type]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def model_path(file_type: str, root: Path | None = None) -> Path:
    folder = (cache_root() if root is None else root) / "bench-models"
    return folder / f"{NAME}-shape-{file_type}-v{VERSION}.gguf"


def write_model(
    path: Path, file_type: str, shape: MlaShape = V2_LITE, seed: int = 0, tokenizer: Path | None = None
) -> Path:
    """Write the GGUF (atomically: a temporary file renamed) and return ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), "deepseek2")
    _metadata(writer, shape, file_type)
    _copy_tokenizer(writer, embedded_gguf_path() if tokenizer is None else tokenizer, shape.vocab)
    listed = tensors(shape, file_type)
    declare_tensors(writer, listed)
    rng = np.random.default_rng(seed)
    for _name, qtype, dims in listed:
        if qtype is not None:
            data = random_blocks(qtype, math.prod(dims[:-1]), dims[-1], rng)
        elif len(dims) == 1:
            data = np.ones(dims, dtype=np.float32)
        else:
            data = rng.normal(0.0, WEIGHT_STD, size=dims).astype(np.float32)
        writer.write_tensor_data(data)
    writer.close()
    os.replace(tmp, path)
    return path


def ensure_model(file_type: str, root: Path | None = None) -> Path:
    """The path of ``deepseekv2lite-<file_type>``, made first if it is not there."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"no bench model {NAME}-{file_type}; types: {', '.join(FILE_TYPES)}")
    path = model_path(file_type, root)
    return path if path.is_file() else write_model(path, file_type)
