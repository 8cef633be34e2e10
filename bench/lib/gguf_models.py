"""Bigger GGUFs for the benches: a Llama-3.2-1B-shaped model in the types people download, and a
Qwen3-30B-A3B-shaped mixture of experts with fewer layers.

The command is ``python -m bench.gguf_models`` (bench/gguf_models.py).

``llama1b`` is Llama 3.2 1B's shape (hidden 2048, 16 layers, 32 query / 8 KV heads of 64, FFN 8192,
RMSNorm eps 1e-5, rope theta 500000, tied embedding). ``qwen3moe30b`` is Qwen3-30B-A3B's
(architecture ``qwen3moe``: hidden 2048, 32 query / 4 KV heads of 128 with QK norms, 128 experts of
768 of which 8 are used per token, a router ``ffn_gate_inp`` in F32, the experts stacked per
projection as ``ffn_{gate,up,down}_exps`` [experts, rows, cols], an untied output) with 8 of its 48
layers. Both take SmolLM2's vocabulary: the 49152 tokens and every ``tokenizer.*`` field are copied
from the embedded GGUF, so rivulet and llama.cpp tokenize a prompt alike. The weights are random
blocks built directly (gguf-py cannot quantize K-quants): random quants, and per block scales that
give zero-mean weights of std ~0.02, so the hidden states stay finite through every layer. The
output is noise; the benches ignore EOS.

Which type each tensor takes follows llama.cpp's ``llama-quantize`` for the file type:
- ``q4_k_m``: Q4_K, except ``attn_v`` and ``ffn_down`` (``ffn_down_exps``) in Q6_K in the "more
  bits" layers (the first and last eighth, and every third between: 8 of 16, 4 of 8), and the
  output (a tied embedding) in Q6_K; an untied embedding stays Q4_K. Half the layers' q/k/v
  projections thus mix Q4_K and Q6_K, and half the layers' experts Q4_K gate/up with Q6_K down.
- ``q4_0``, ``q4_1``: every layer tensor of that type, the output in Q6_K.
- ``q8_0``: everything Q8_0.
Norms are F32 ones, the router F32 random. Files go to ``<cache root>/bench-models/``
(``$RIVULET_CACHE_DIR`` or ``~/.cache/rivulet``), named by shape, type and ``VERSION``; never part of
the repository.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from gpu_worker.weights.model_files import cache_root, embedded_gguf_path

Q = gguf.GGMLQuantizationType
VERSION = 1  # bump when the bytes a name stands for change
WEIGHT_STD = 0.02


@dataclass(frozen=True)
class Shape:
    """A decoder's sizes, as the GGUF's ``<arch>.*`` fields carry them. ``experts`` > 0: every layer
    a mixture of experts (a router and ``experts`` stacked experts of ``expert_ffn``, ``experts_used``
    per token) in place of the dense FFN."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 49152
    context: int = 8192
    rope_theta: float = 500000.0
    eps: float = 1e-5
    arch: str = "llama"
    key_length: int = 0  # the head size where it is not hidden / heads
    tied: bool = True
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0

    @property
    def head_dim(self) -> int:
        return self.key_length or self.hidden // self.heads

    @property
    def qk_norms(self) -> bool:
        return self.arch in ("qwen3", "qwen3moe")


LLAMA_1B = Shape("llama1b", hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192)
# Qwen3-30B-A3B's config with 8 of its 48 layers (the dense feed_forward_length is its config's,
# which no layer uses). A test writes it smaller with dataclasses.replace.
QWEN3_MOE_30B = Shape(
    "qwen3moe30b", hidden=2048, layers=8, heads=32, kv_heads=4, ffn=6144, context=40960,
    rope_theta=1e6, eps=1e-6, arch="qwen3moe", key_length=128, tied=False,
    experts=128, experts_used=8, expert_ffn=768,
)  # fmt: skip
SHAPES = {shape.name: shape for shape in (LLAMA_1B, QWEN3_MOE_30B)}
FILE_TYPES = {
    "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}
_BASE_TYPE = {"q4_k_m": Q.Q4_K, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q8_0": Q.Q8_0}
_MORE_BITS_ROLES = ("attn_v", "ffn_down", "ffn_down_exps")
_F32_ROLES = ("attn_norm", "attn_q_norm", "attn_k_norm", "ffn_norm", "ffn_gate_inp")  # norms, router


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers whose v and down take Q6_K in a Q4_K_M file."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(file_type: str, role: str, layer: int, layers: int) -> Q:
    """The block type llama-quantize gives tensor ``role`` (attn_q, ffn_down_exps, output, ...); a
    tied embedding takes the output's."""
    base = _BASE_TYPE[file_type]
    if role == "output":  # Q6_K unless the file is Q8_0
        return Q.Q8_0 if base == Q.Q8_0 else Q.Q6_K
    if file_type == "q4_k_m" and role in _MORE_BITS_ROLES and more_bits(layer, layers):
        return Q.Q6_K
    return base


def random_blocks(
    qtype: Q, rows: int, cols: int, rng: np.random.Generator, std: float = WEIGHT_STD
) -> np.ndarray:
    """uint8 [rows, row bytes] of ``qtype``: random quants, scales that make zero-mean weights of
    about ``std`` (each block's scale varied by +-25%)."""
    size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    nb = rows * cols // size
    blocks = rng.integers(0, 256, size=(nb, block_bytes), dtype=np.uint8)
    jitter = rng.uniform(0.75, 1.25, size=nb)

    def put_f16(at: int, values: np.ndarray) -> None:
        blocks[:, at : at + 2] = values.astype(np.float16).view(np.uint8).reshape(nb, 2)

    if qtype in (Q.Q4_K, Q.Q5_K):
        # 6-bit scales sc = m in [32, 63]: weight = d sc q - dmin m, q uniform on [0, 2^bits);
        # dmin = d (2^bits - 1) / 2 centres each sub-block.
        levels = 16 if qtype == Q.Q4_K else 32
        sc = rng.integers(32, 64, size=(nb, 8), dtype=np.uint8)
        packed = np.zeros((nb, 12), dtype=np.uint8)
        packed[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)  # sc 0-3, high bits of sc 4-7
        packed[:, 4:8] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)  # m = sc
        packed[:, 8:12] = (sc[:, 4:8] & 15) | ((sc[:, 4:8] & 15) << 4)
        blocks[:, 4:16] = packed
        d = std / (48 * levels / 12**0.5) * jitter
        put_f16(0, d)
        put_f16(2, d * (levels - 1) / 2)
    elif qtype == Q.Q6_K:  # weight = d scale (q - 32), q uniform on [0, 64), int8 scales in [64, 127]
        blocks[:, 192:208] = rng.integers(64, 128, size=(nb, 16), dtype=np.uint8)
        put_f16(208, std / (96 * 64 / 12**0.5) * jitter)
    elif qtype == Q.Q8_0:  # weight = d q, q uniform on [-128, 128)
        put_f16(0, std / (256 / 12**0.5) * jitter)
    elif qtype in (Q.Q4_0, Q.Q4_1):  # Q4_0: d (q - 8); Q4_1: d q + m, m = -7.5 d
        d = std / (16 / 12**0.5) * jitter
        put_f16(0, d)
        if qtype == Q.Q4_1:
            put_f16(2, -7.5 * d)
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return blocks.reshape(rows, -1)


Dims = tuple[int, ...]  # numpy's order: [experts,] rows, cols


def _tensors(shape: Shape, file_type: str) -> list[tuple[str, Q | None, Dims]]:
    """(GGUF name, block type or None for F32, dims) of every tensor, in llama.cpp's order. The F32
    ones are norms (one dim) and routers."""
    h, q, kv, n = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.layers
    embedding = tensor_type(file_type, "output" if shape.tied else "token_embd", 0, n)
    out: list[tuple[str, Q | None, Dims]] = [("token_embd.weight", embedding, (shape.vocab, h))]
    e, f = shape.experts, shape.expert_ffn
    ffn: dict[str, Dims] = (
        {"ffn_gate_exps": (e, f, h), "ffn_up_exps": (e, f, h), "ffn_down_exps": (e, h, f)}
        if e
        else {"ffn_gate": (shape.ffn, h), "ffn_up": (shape.ffn, h), "ffn_down": (h, shape.ffn)}
    )
    attn: dict[str, Dims] = {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q)}
    for i in range(n):
        layer: list[tuple[str, Dims]] = [("attn_norm", (h,)), *attn.items()]
        if shape.qk_norms:
            layer += [("attn_q_norm", (shape.head_dim,)), ("attn_k_norm", (shape.head_dim,))]
        layer += [("ffn_norm", (h,)), *([("ffn_gate_inp", (e, h))] if e else []), *ffn.items()]
        out += [
            (
                f"blk.{i}.{role}.weight",
                None if role in _F32_ROLES else tensor_type(file_type, role, i, n),
                dims,
            )
            for role, dims in layer
        ]
    out.append(("output_norm.weight", None, (h,)))
    if not shape.tied:
        out.append(("output.weight", tensor_type(file_type, "output", 0, n), (shape.vocab, h)))
    return out


def model_path(shape: Shape, file_type: str, root: Path | None = None) -> Path:
    folder = (cache_root() if root is None else root) / "bench-models"
    return folder / f"{shape.name}-shape-{file_type}-v{VERSION}.gguf"


def _copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> None:
    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def write_model(
    path: Path, shape: Shape, file_type: str, seed: int = 0, tokenizer: Path | None = None
) -> Path:
    """Write the GGUF (atomically: a temporary file renamed) and return ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), shape.arch)
    _add_metadata(writer, shape, file_type)
    _copy_tokenizer(writer, embedded_gguf_path() if tokenizer is None else tokenizer)
    tensors = _tensors(shape, file_type)
    for name, qtype, dims in tensors:
        if qtype is None:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), math.prod(dims) * 4)
        else:
            size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            row_bytes = dims[-1] // size * block_bytes
            nbytes = math.prod(dims[:-1]) * row_bytes
            writer.add_tensor_info(name, (*dims[:-1], row_bytes), np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, qtype, dims in tensors:
        if qtype is not None:  # written as [rows, row bytes]: the file holds the bytes alone
            data = random_blocks(qtype, math.prod(dims[:-1]), dims[-1], rng)
        elif len(dims) == 1:
            data = np.ones(dims, dtype=np.float32)
        else:
            data = rng.normal(0.0, WEIGHT_STD, size=dims).astype(np.float32)
        writer.write_tensor_data(data)
    writer.close()
    os.replace(tmp, path)
    return path


def _add_metadata(writer: gguf.GGUFWriter, shape: Shape, file_type: str) -> None:
    writer.add_name(f"{shape.name}-shape {file_type} (random blocks, rivulet bench)")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    if shape.key_length:
        writer.add_key_length(shape.key_length)
        writer.add_value_length(shape.key_length)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ffn)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.eps)
    writer.add_file_type(int(FILE_TYPES[file_type]))
    writer.add_vocab_size(shape.vocab)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def ensure_model(name: str, root: Path | None = None) -> Path:
    """The path of bench model ``name`` (``llama1b-q4_k_m``, ``qwen3moe30b-q4_k_m``, ...), made
    first if it is not there."""
    shape_name, _, file_type = name.partition("-")
    if shape_name not in SHAPES or file_type not in FILE_TYPES:
        names = ", ".join(f"{s}-{t}" for s in SHAPES for t in FILE_TYPES)
        raise ValueError(f"no bench model {name!r}; one of {names}")
    shape = SHAPES[shape_name]
    path = model_path(shape, file_type, root)
    return path if path.is_file() else write_model(path, shape, file_type)


def resolve(model: str | None) -> str | None:
    """A ``--model`` argument with bench model names (``llama1b-q4_k_m``) replaced by their paths."""
    if model is None or Path(model).expanduser().exists() or model.partition("-")[0] not in SHAPES:
        return model
    return str(ensure_model(model))
