"""Qwen3.5-shaped GGUFs for the hybrid-model benches (bench/lib/gguf_models.py's kind: random blocks,
SmolLM2's tokenizer padded to the vocabulary): ``qwen35_4b-<type>`` and ``qwen35moe_35b-<type>``.

``qwen35_4b`` is Qwen3.5-4B's config (architecture ``qwen35``): hidden 2560, full attention 16 query /
4 KV heads of 256 (q_proj with its output gate: 2 x 16 x 256 rows), a quarter of each head rotating,
FFN 9216, Gated DeltaNet layers of 16 key heads and 32 value heads of 128 (conv kernel 4), tied
embedding; 8 of its 32 layers, keeping its 3 linear to 1 full (layers 3 and 7 full). ``qwen35moe_35b``
is Qwen3.5-35B-A3B's (``qwen35moe``): hidden 2048, 16 query / 2 KV heads of 256, 256 experts of 512
(8 a token) beside a shared expert of 512 with its sigmoid gate, the same linear layers; 8 of its 40
layers. Both have SmolLM2's 49152-token vocabulary (the real ones have 248320: the head and the
embedding are then smaller than theirs).

Types follow bench/lib/gguf_models.py's ``tensor_type`` for the file type (Q4_K_M: Q4_K, v / down
projections Q6_K in the "more bits" layers, the output Q6_K); the linear layers' projections take
their nearest role's type (``attn_qkv`` as ``attn_v``, ``attn_gate`` / ``ssm_alpha`` / ``ssm_beta``
as ``attn_q``, ``ssm_out`` as ``attn_output``). Norms, the conv1d, A, dt and the routers are F32
(A = -1, so the decay is -softplus(a + dt)).

``python -m bench.lib.gguf_hybrid_model qwen35_4b-q4_k_m`` writes the file if missing and prints its path.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from bench.lib.gguf_blocks import declare_tensors, random_blocks
from bench.lib.gguf_models import FILE_TYPES, WEIGHT_STD, Q, _copy_tokenizer, tensor_type
from gpu_worker.weights.model_files import cache_root, embedded_gguf_path

VERSION = 1
VOCAB = 49152
Dims = tuple[int, ...]
_ROLE_OF = {"attn_qkv": "attn_v", "attn_gate": "attn_q", "ssm_alpha": "attn_q", "ssm_beta": "attn_q",
            "ssm_out": "attn_output", "ffn_down_exps": "ffn_down", "ffn_down_shexp": "ffn_down"}  # fmt: skip


@dataclass(frozen=True)
class HybridShape:
    name: str
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int = 0
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    head_dim: int = 256
    key_heads: int = 16
    value_heads: int = 32
    linear_dim: int = 128
    conv: int = 4
    full_every: int = 4
    tied: bool = True


SHAPES = {
    s.name: s
    for s in (
        HybridShape("qwen35_4b", "qwen35", hidden=2560, layers=8, heads=16, kv_heads=4, ffn=9216),
        HybridShape(
            "qwen35moe_35b",
            "qwen35moe",
            hidden=2048,
            layers=8,
            heads=16,
            kv_heads=2,
            experts=256,
            experts_used=8,
            expert_ffn=512,
            shared_ffn=512,
            tied=False,
        ),  # fmt: skip
    )
}


def _layer(s: HybridShape, i: int) -> list[tuple[str, Dims]]:
    h, lin = s.hidden, s.linear_dim
    conv = 2 * s.key_heads * lin + s.value_heads * lin
    if (i + 1) % s.full_every:
        mixer: list[tuple[str, Dims]] = [
            ("attn_qkv", (conv, h)), ("attn_gate", (s.value_heads * lin, h)),
            ("ssm_beta", (s.value_heads, h)), ("ssm_alpha", (s.value_heads, h)),
            ("ssm_conv1d", (conv, s.conv)), ("ssm_a", (s.value_heads,)), ("ssm_dt", (s.value_heads,)),
            ("ssm_norm", (lin,)), ("ssm_out", (h, s.value_heads * lin)),
        ]  # fmt: skip
    else:
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        mixer = [("attn_q", (2 * q, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)), ("attn_output", (h, q)),
                 ("attn_q_norm", (s.head_dim,)), ("attn_k_norm", (s.head_dim,))]  # fmt: skip
    out = [("attn_norm", (h,)), *mixer, ("post_attention_norm", (h,))]
    if not s.experts:
        return out + [("ffn_gate", (s.ffn, h)), ("ffn_up", (s.ffn, h)), ("ffn_down", (h, s.ffn))]
    e, f, sf = s.experts, s.expert_ffn, s.shared_ffn
    return out + [
        ("ffn_gate_inp", (e, h)), ("ffn_gate_exps", (e, f, h)), ("ffn_up_exps", (e, f, h)),
        ("ffn_down_exps", (e, h, f)), ("ffn_gate_inp_shexp", (h,)), ("ffn_gate_shexp", (sf, h)),
        ("ffn_up_shexp", (sf, h)), ("ffn_down_shexp", (h, sf)),
    ]  # fmt: skip


def _name(i: int, role: str) -> str:
    return {"ssm_a": f"blk.{i}.ssm_a", "ssm_dt": f"blk.{i}.ssm_dt.bias"}.get(role, f"blk.{i}.{role}.weight")


def tensors(s: HybridShape, file_type: str) -> list[tuple[str, Q | None, Dims]]:
    """(GGUF name, block type or None for F32, dims) of every tensor, in llama.cpp's order."""
    embedding = tensor_type(file_type, "output" if s.tied else "token_embd", 0, s.layers, cols=s.hidden)
    out: list[tuple[str, Q | None, Dims]] = [("token_embd.weight", embedding, (VOCAB, s.hidden))]
    gqa = s.heads // s.kv_heads
    for i in range(s.layers):
        for role, dims in _layer(s, i):
            f32 = len(dims) == 1 or role in ("ffn_gate_inp", "ssm_conv1d")
            qtype = (
                None if f32 else tensor_type(file_type, _ROLE_OF.get(role, role), i, s.layers, dims[-1], gqa)
            )
            out.append((_name(i, role), qtype, dims))
    out.append(("output_norm.weight", None, (s.hidden,)))
    if not s.tied:
        out.append(
            ("output.weight", tensor_type(file_type, "output", 0, s.layers, cols=s.hidden), (VOCAB, s.hidden))
        )
    return out


def _metadata(writer: gguf.GGUFWriter, s: HybridShape, file_type: str) -> None:
    """convert_hf_to_gguf.py's Qwen3.5 parameters for this config."""
    writer.add_name(f"{s.name}-shape {file_type} (random blocks, rivulet bench)")
    writer.add_block_count(s.layers)
    writer.add_context_length(262144)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.ffn or s.expert_ffn)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e7)
    writer.add_rope_dimension_count(s.head_dim // 4)
    writer.add_rope_dimension_sections([11, 11, 10, 0])
    writer.add_ssm_conv_kernel(s.conv)
    writer.add_ssm_state_size(s.linear_dim)
    writer.add_ssm_group_count(s.key_heads)
    writer.add_ssm_time_step_rank(s.value_heads)
    writer.add_ssm_inner_size(s.value_heads * s.linear_dim)
    writer.add_full_attention_interval(s.full_every)
    if s.experts:
        writer.add_expert_count(s.experts)
        writer.add_expert_used_count(s.experts_used)
        writer.add_expert_feed_forward_length(s.expert_ffn)
        writer.add_expert_shared_feed_forward_length(s.shared_ffn)
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(int(FILE_TYPES[file_type]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def model_path(name: str, root: Path | None = None) -> Path:
    return (cache_root() if root is None else root) / "bench-models" / f"{name}-shape-v{VERSION}.gguf"


def write_model(path: Path, s: HybridShape, file_type: str, seed: int = 0) -> Path:
    """Write the GGUF (atomically: a temporary file renamed) and return ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), s.arch)
    _metadata(writer, s, file_type)
    _copy_tokenizer(writer, embedded_gguf_path(), VOCAB)
    listed = tensors(s, file_type)
    declare_tensors(writer, listed)
    rng = np.random.default_rng(seed)
    for name, qtype, dims in listed:
        if qtype is not None:
            data = random_blocks(qtype, math.prod(dims[:-1]), dims[-1], rng)
        elif len(dims) == 1:  # norms stored as 1 + w (w = 0); A = -1
            data = np.full(dims, -1.0 if name.endswith("ssm_a") else 1.0, dtype=np.float32)
        else:
            data = rng.normal(0.0, WEIGHT_STD, size=dims).astype(np.float32)
        writer.write_tensor_data(data)
    writer.close()
    os.replace(tmp, path)
    return path


def ensure_model(name: str, root: Path | None = None) -> Path:
    """The path of ``<shape>-<file type>`` (``qwen35_4b-q4_k_m``), made first if it is not there."""
    shape, _, file_type = name.partition("-")
    if shape not in SHAPES or file_type not in FILE_TYPES:
        raise ValueError(f"no hybrid bench model {name!r}; one of {', '.join(f'{s}-q4_k_m' for s in SHAPES)}")
    path = model_path(name, root)
    return path if path.is_file() else write_model(path, SHAPES[shape], file_type)


if __name__ == "__main__":
    print(ensure_model(sys.argv[1] if len(sys.argv) > 1 else "qwen35_4b-q4_k_m"))
