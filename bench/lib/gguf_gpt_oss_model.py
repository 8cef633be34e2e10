"""A gpt-oss-20b-shaped GGUF for the benches (bench/lib/gguf_models.py's kind: random blocks, SmolLM2's
tokenizer padded to the vocabulary; ``gptoss20b-mxfp4``).

gpt-oss-20b's config (architecture ``gpt-oss`` as llama.cpp's converter writes it): hidden 2880, 64
query / 8 KV heads of 64 with biases on q/k/v/o and a sink per head, 32 experts of 2880 of which 4
are used per token (router with a bias; expert projections stacked ``ffn_{gate,up,down}_exps`` with
biases), a 201088-token vocabulary, an untied output, a 128-token window on every even layer, YaRN
(factor 32 over 4096 positions, theta 150000) to 131072 positions. It has 8 of its 24 layers (the
alternation kept). The experts are MXFP4 as the release ships them (random nibbles, exponents that
give weights of std ~0.02); the other matrices BF16 as the converter writes them; norms, sinks,
biases and the router F32.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from bench.lib.gguf_models import WEIGHT_STD, Q, _copy_tokenizer
from gpu_worker.weights.model_files import cache_root, embedded_gguf_path

NAME = "gptoss20b"
VERSION = 1
FILE_TYPES = ("mxfp4",)
Dims = tuple[int, ...]


@dataclass(frozen=True)
class GptOssShape:
    """gpt-oss-20b's sizes (8 of its 24 layers); a test writes it smaller with replace."""

    hidden: int = 2880
    layers: int = 8
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 64
    vocab: int = 201088
    context: int = 131072
    experts: int = 32
    used: int = 4
    expert_ffn: int = 2880
    window: int = 128


GPT_OSS_20B = GptOssShape()


def tensors(shape: GptOssShape) -> list[tuple[str, Q, Dims]]:
    """(GGUF name, type, dims) of every tensor, in llama.cpp's order."""
    h, q, kv, e, f = (shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim,
                      shape.experts, shape.expert_ffn)  # fmt: skip
    out: list[tuple[str, Q, Dims]] = [("token_embd.weight", Q.BF16, (shape.vocab, h))]
    for i in range(shape.layers):
        out += [
            (f"blk.{i}.{name}", qtype, dims)
            for name, qtype, dims in [
                ("attn_norm.weight", Q.F32, (h,)),
                ("attn_q.weight", Q.BF16, (q, h)), ("attn_q.bias", Q.F32, (q,)),
                ("attn_k.weight", Q.BF16, (kv, h)), ("attn_k.bias", Q.F32, (kv,)),
                ("attn_v.weight", Q.BF16, (kv, h)), ("attn_v.bias", Q.F32, (kv,)),
                ("attn_output.weight", Q.BF16, (h, q)), ("attn_output.bias", Q.F32, (h,)),
                ("attn_sinks.weight", Q.F32, (shape.heads,)), ("post_attention_norm.weight", Q.F32, (h,)),
                ("ffn_gate_inp.weight", Q.F32, (e, h)), ("ffn_gate_inp.bias", Q.F32, (e,)),
                ("ffn_gate_exps.weight", Q.MXFP4, (e, f, h)), ("ffn_gate_exps.bias", Q.F32, (e, f)),
                ("ffn_up_exps.weight", Q.MXFP4, (e, f, h)), ("ffn_up_exps.bias", Q.F32, (e, f)),
                ("ffn_down_exps.weight", Q.MXFP4, (e, h, f)), ("ffn_down_exps.bias", Q.F32, (e, h)),
            ]
        ]  # fmt: skip
    return out + [("output_norm.weight", Q.F32, (h,)), ("output.weight", Q.BF16, (shape.vocab, h))]


def _metadata(writer: gguf.GGUFWriter, shape: GptOssShape) -> None:
    """convert_hf_to_gguf.py's GptOssModel.set_gguf_parameters for this config."""
    writer.add_name(f"{NAME}-shape mxfp4 (random blocks, rivulet bench)")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.expert_ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.used)
    writer.add_expert_feed_forward_length(shape.expert_ffn)
    writer.add_sliding_window(shape.window)
    writer.add_rope_freq_base(150000.0)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(32.0)
    writer.add_rope_scaling_orig_ctx_len(4096)
    writer.add_rope_scaling_yarn_beta_fast(32.0)
    writer.add_rope_scaling_yarn_beta_slow(1.0)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _values(qtype: Q, dims: Dims, name: str, rng: np.random.Generator) -> np.ndarray:
    """A tensor's bytes (MXFP4, BF16) or float32 values: norms 1, the rest random of std ~0.02."""
    rows, cols = math.prod(dims[:-1]), dims[-1]
    if qtype == Q.MXFP4:  # E2M1 levels' rms ~2.9 at scale 1: exponent 2^-7 (byte 120) gives ~0.02
        blocks = rng.integers(0, 256, size=(rows * cols // 32, 17), dtype=np.uint8)
        blocks[:, 0] = rng.integers(119, 122, size=rows * cols // 32, dtype=np.uint8)
        return blocks.reshape(rows, -1)
    values = rng.normal(0.0, WEIGHT_STD, size=(rows, cols)).astype(np.float32)
    if "norm" in name:
        values = np.ones((rows, cols), dtype=np.float32)
    if qtype == Q.BF16:
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
    return values.reshape(dims)


def model_path(root: Path | None = None) -> Path:
    folder = (cache_root() if root is None else root) / "bench-models"
    return folder / f"{NAME}-shape-mxfp4-v{VERSION}.gguf"


def write_model(
    path: Path, shape: GptOssShape = GPT_OSS_20B, seed: int = 0, tokenizer: Path | None = None
) -> Path:
    """Write the GGUF (atomically: a temporary file renamed) and return ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), "gpt-oss")
    _metadata(writer, shape)
    _copy_tokenizer(writer, embedded_gguf_path() if tokenizer is None else tokenizer, shape.vocab)
    listed = tensors(shape)
    for name, qtype, dims in listed:
        if qtype == Q.F32:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), math.prod(dims) * 4)
        else:
            size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            row_bytes = dims[-1] // size * block_bytes
            writer.add_tensor_info(name, (*dims[:-1], row_bytes), np.dtype(np.uint8),
                                   math.prod(dims[:-1]) * row_bytes, raw_dtype=qtype)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, qtype, dims in listed:
        writer.write_tensor_data(_values(qtype, dims, name, rng))
    writer.close()
    os.replace(tmp, path)
    return path


def ensure_model(file_type: str, root: Path | None = None) -> Path:
    """The path of ``gptoss20b-mxfp4``, made first if it is not there."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"no bench model {NAME}-{file_type}; types: {', '.join(FILE_TYPES)}")
    path = model_path(root)
    return path if path.is_file() else write_model(path)
