"""A Gemma-4-shaped GGUF for the benches (``gemma4_e4b``, architecture ``gemma4``): Gemma 4 E4B's text
decoder with 12 of its 42 layers.

E4B's sizes: hidden 2560, 8 query heads, 2 KV heads of 256 on the sliding layers (a 512-token window)
and of 512 on the global ones (every 6th; a proportional rope rotating a quarter of each head, theta
1e6; sliding theta 1e4), FFN 10240, per-layer inputs of 256 (a [262144, layers x 256] table and its
projection), its last layers reading earlier layers' KV (18 of 42 there: 6 of 12 here, so the last
owner is a global layer and the one before it sliding, as llama.cpp's loader takes them), final logits
soft-capped at 30, a tied 262144-token embedding. Written as llama.cpp's converter and
``llama-quantize`` lay such a file out (bench/lib/gguf_models.py's types: Q4_K, v and down Q6_K in the
"more bits" layers, the tied embedding Q6_K; the per-layer table is taken as an untied embedding,
Q4_K), with random blocks, norms 1, layer scalars 1 and the ``rope_freqs`` tensor the global layers
read. SmolLM2's tokenizer, padded to the vocabulary.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from bench.lib.gguf_blocks import declare_tensors, random_blocks
from bench.lib.gguf_models import FILE_TYPES, WEIGHT_STD, Q, Shape, _copy_tokenizer, model_path, tensor_type
from gpu_worker.weights.model_files import embedded_gguf_path


@dataclass(frozen=True)
class Gemma4Shape(Shape):
    """Gemma 4's sizes beyond a decoder's (``key_length`` is the sliding layers' head size)."""

    global_head_dim: int = 512
    global_kv_heads: int = 2
    per_layer_dim: int = 256
    shared_kv_layers: int = 0
    global_every: int = 6  # every 6th layer global
    rotated_share: float = 0.25
    softcap: float = 30.0

    def sliding(self, layer: int) -> bool:
        return (layer + 1) % self.global_every != 0 and layer != self.layers - 1


GEMMA4_E4B = Gemma4Shape(
    "gemma4_e4b", hidden=2560, layers=12, heads=8, kv_heads=2, ffn=10240, vocab=262144, context=32768,
    rope_theta=1e6, eps=1e-6, arch="gemma4", key_length=256, sliding_window=512, local_rope_theta=1e4,
    shared_kv_layers=6,
)  # fmt: skip
_F32_ROLES = ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm",
              "post_norm", "layer_output_scale")  # fmt: skip
Dims = tuple[int, ...]


def _layer_tensors(shape: Gemma4Shape, i: int, file_type: str) -> list[tuple[str, Q | None, Dims]]:
    h, n = shape.hidden, shape.layers
    sliding = shape.sliding(i)
    dim = shape.head_dim if sliding else shape.global_head_dim
    kv_heads = shape.kv_heads if sliding else shape.global_kv_heads
    q, kv = shape.heads * dim, kv_heads * dim
    owns_kv = i < n - shape.shared_kv_layers
    roles: list[tuple[str, Dims]] = [("attn_norm", (h,)), ("attn_q", (q, h))]
    if owns_kv:
        roles += [("attn_k", (kv, h)), ("attn_v", (kv, h)), ("attn_k_norm", (dim,))]
    roles += [("attn_q_norm", (dim,)), ("attn_output", (h, q)), ("post_attention_norm", (h,))]
    roles += [("ffn_norm", (h,)), ("ffn_gate", (shape.ffn, h)), ("ffn_up", (shape.ffn, h))]
    roles += [("ffn_down", (h, shape.ffn)), ("post_ffw_norm", (h,))]
    p = shape.per_layer_dim
    roles += [("inp_gate", (p, h)), ("proj", (h, p)), ("post_norm", (h,)), ("layer_output_scale", (1,))]
    gqa = shape.heads // kv_heads
    return [
        (
            f"blk.{i}.{role}.weight",
            None if role in _F32_ROLES else tensor_type(file_type, role, i, n, d[-1], gqa),
            d,
        )
        for role, d in roles
    ]


def _tensors(shape: Gemma4Shape, file_type: str) -> list[tuple[str, Q | None, Dims]]:
    h, n, width = shape.hidden, shape.layers, shape.layers * shape.per_layer_dim
    table = tensor_type(file_type, "token_embd", 0, n, width)  # the per-layer table: an untied embedding's
    out: list[tuple[str, Q | None, Dims]] = [
        ("token_embd.weight", tensor_type(file_type, "output", 0, n, cols=h), (shape.vocab, h)),
        ("per_layer_token_embd.weight", table, (shape.vocab, width)),
        ("per_layer_model_proj.weight", tensor_type(file_type, "attn_q", 0, n, cols=h), (width, h)),
        ("per_layer_proj_norm.weight", None, (shape.per_layer_dim,)),
        ("rope_freqs.weight", None, (shape.global_head_dim // 2,)),
    ]  # fmt: skip
    for i in range(n):
        out += _layer_tensors(shape, i, file_type)
    out.append(("output_norm.weight", None, (h,)))
    return out


def _f32_values(name: str, shape: Gemma4Shape, dims: Dims) -> np.ndarray:
    """Norms and layer scalars 1; rope_freqs 1 for each rotated pair, 1e30 (no rotation) beyond."""
    if name == "rope_freqs.weight":
        rotated = int(shape.global_head_dim * shape.rotated_share / 2)
        return np.array([1.0] * rotated + [1e30] * (dims[0] - rotated), dtype=np.float32)
    return np.ones(dims, dtype=np.float32)


def write_gemma4(
    path: Path, shape: Gemma4Shape, file_type: str, seed: int = 0, tokenizer: Path | None = None
) -> Path:
    """Write the GGUF (atomically: a temporary file renamed) and return ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), "gemma4")
    _add_metadata(writer, shape, file_type)
    _copy_tokenizer(writer, embedded_gguf_path() if tokenizer is None else tokenizer, shape.vocab)
    tensors = _tensors(shape, file_type)
    declare_tensors(writer, tensors)
    rng = np.random.default_rng(seed)
    for name, qtype, dims in tensors:
        if qtype is None:
            writer.write_tensor_data(_f32_values(name, shape, dims))
        else:
            writer.write_tensor_data(random_blocks(qtype, math.prod(dims[:-1]), dims[-1], rng, WEIGHT_STD))
    writer.close()
    os.replace(tmp, path)
    return path


def _add_metadata(writer: gguf.GGUFWriter, shape: Gemma4Shape, file_type: str) -> None:
    n = shape.layers
    writer.add_name(f"{shape.name}-shape {file_type} (random blocks, rivulet bench)")
    writer.add_block_count(n)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(
        [shape.kv_heads if shape.sliding(i) else shape.global_kv_heads for i in range(n)]
    )
    writer.add_key_length(shape.global_head_dim)
    writer.add_value_length(shape.global_head_dim)
    writer.add_key_length_swa(shape.head_dim)
    writer.add_value_length_swa(shape.head_dim)
    writer.add_rope_dimension_count(shape.global_head_dim)
    writer.add_rope_dimension_count_swa(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_freq_base_swa(shape.local_rope_theta)
    writer.add_sliding_window(shape.sliding_window)
    writer.add_sliding_window_pattern([shape.sliding(i) for i in range(n)])
    writer.add_shared_kv_layers(shape.shared_kv_layers)
    writer.add_embedding_length_per_layer_input(shape.per_layer_dim)
    writer.add_final_logit_softcapping(shape.softcap)
    writer.add_layer_norm_rms_eps(shape.eps)
    writer.add_file_type(int(FILE_TYPES[file_type]))
    writer.add_vocab_size(shape.vocab)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def ensure_model(file_type: str, root: Path | None = None) -> Path:
    """The path of ``gemma4_e4b-<file_type>``, made first if it is not there."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"no bench model gemma4_e4b-{file_type}; types: {', '.join(FILE_TYPES)}")
    path = model_path(GEMMA4_E4B, file_type, root)
    return path if path.is_file() else write_gemma4(path, GEMMA4_E4B, file_type)
