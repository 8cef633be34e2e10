"""Bigger GGUFs for the benches: a Llama-3.2-1B-shaped model in the types people download, a
Gemma-3-270M-shaped one, and a Qwen3-30B-A3B-shaped mixture of experts with fewer layers
(``python -m bench.gguf_models``).

``llama1b`` is Llama 3.2 1B's shape (hidden 2048, 16 layers, 32 query / 8 KV heads of 64, FFN 8192,
RMSNorm eps 1e-5, rope theta 500000, tied embedding). ``gemma3_270m`` is Gemma 3 270M's (hidden 640,
18 layers, 4 query / 1 KV head of 256 with QK norms and Gemma's norms after attention and FFN, FFN
2048, 5 of every 6 layers on a 512-token window, a 262144-token vocabulary, tied). ``qwen3moe30b`` is
Qwen3-30B-A3B's (architecture ``qwen3moe``: hidden 2048, 32 query / 4 KV heads of 128 with QK norms,
128 experts of 768 of which 8 are used per token, a router ``ffn_gate_inp`` in F32, the experts
stacked per projection as ``ffn_{gate,up,down}_exps`` [experts, rows, cols], an untied output) with 8
of its 48 layers. All take SmolLM2's vocabulary: the 49152 tokens and every ``tokenizer.*`` field are
copied from the embedded GGUF (padded with unused tokens to a larger vocabulary), so rivulet and
llama.cpp tokenize a prompt alike. The weights are random blocks built directly
(bench/lib/gguf_blocks.py: gguf-py cannot quantize K-quants or IQ types): random quants, and per
block scales that give zero-mean weights of std ~0.02, so the hidden states stay finite through every
layer. The output is noise; the benches ignore EOS.

Which type each tensor takes follows llama.cpp's ``llama-quantize`` for the file type:
- ``q4_k_m``: Q4_K, except ``attn_v`` and ``ffn_down`` (``ffn_down_exps``) in Q6_K in the "more
  bits" layers (the first and last eighth, and every third between: 8 of 16, 4 of 8), and the output
  (a tied embedding) in Q6_K; an untied embedding stays Q4_K (so q/k/v and experts mix types).
- ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``, ``iq4_nl``, ``iq4_xs``: every layer tensor of that type,
  the output in Q6_K; ``iq4_*`` with llama.cpp's exceptions: ``attn_v`` in Q5_K where 4 or more query
  heads share a KV head, ``ffn_down`` in Q5_K in the first eighth of the layers.
- ``q3_k_m``, ``q2_k``: Q3_K / Q2_K, with llama.cpp's exceptions: v Q5_K in the first two layers
  then Q4_K (Q2_K: Q4_K where 4 or more query heads share a KV head), down Q5_K in the first
  sixteenth then Q4_K (Q2_K: Q3_K), o Q4_K (Q2_K: Q3_K).
- ``q8_0``: everything Q8_0. ``bf16``, ``f16``: every weight in that type (as the converter writes).
- ``mixed``: ``q4_k_m`` with q/k/v/o taken as rows not a multiple of 256 (a model of hidden 576,
  640, 896, ... has them so), so they fall back as below: Q5_0, the "more bits" v Q8_0.
In every type, a tensor whose rows are not whole 256-weight super-blocks falls back as llama-quantize
does (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K / Q3_K / IQ4_XS -> IQ4_NL), and one whose rows
are not whole blocks of that stays F16: the Gemma shape's q/k/v/gate/up are Q5_0 in ``q4_k_m``, its
embedding Q8_0. Norms are F32 ones, the router F32 random. Files go to ``<cache
root>/bench-models/`` (``$RIVULET_CACHE_DIR`` or ``~/.cache/rivulet``), named by shape, type and
``VERSION``; never part of the repository.
"""

from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from bench.lib.gguf_blocks import declare_tensors
from bench.lib.gguf_blocks import random_blocks as random_blocks
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
    sliding_window: int = 0  # Gemma 3's local layers (5 of every 6)
    local_rope_theta: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.key_length or self.hidden // self.heads

    @property
    def qk_norms(self) -> bool:
        return self.arch in ("qwen3", "qwen3moe", "gemma3")

    @property
    def post_norms(self) -> bool:
        """Gemma's norms after attention and after the FFN."""
        return self.arch == "gemma3"


LLAMA_1B = Shape("llama1b", hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192)
# Qwen3-30B-A3B's config with 8 of its 48 layers (the dense feed_forward_length is its config's,
# which no layer uses). A test writes it smaller with dataclasses.replace.
QWEN3_MOE_30B = Shape(
    "qwen3moe30b", hidden=2048, layers=8, heads=32, kv_heads=4, ffn=6144, context=40960,
    rope_theta=1e6, eps=1e-6, arch="qwen3moe", key_length=128, tied=False,
    experts=128, experts_used=8, expert_ffn=768,
)  # fmt: skip
# Gemma 3 270M's config: 640-wide rows (not whole K-quant super-blocks: a Q4_K_M file holds q/k/v/gate/up
# in Q5_0), 4 query heads and 1 KV head of 256, 5 of every 6 layers on a 512-token window, a 262144
# token vocabulary (SmolLM2's tokens, padded with unused ones to its size).
GEMMA3_270M = Shape(
    "gemma3_270m", hidden=640, layers=18, heads=4, kv_heads=1, ffn=2048, vocab=262144, context=32768,
    rope_theta=1e6, eps=1e-6, arch="gemma3", key_length=256, sliding_window=512, local_rope_theta=10000.0,
)  # fmt: skip
SHAPES = {shape.name: shape for shape in (LLAMA_1B, QWEN3_MOE_30B, GEMMA3_270M)}
MLA_SHAPE = "deepseekv2lite"  # DeepSeek-V2-Lite's, latent attention (bench/lib/gguf_mla_model.py)
GPT_OSS_SHAPE = "gptoss20b"  # gpt-oss-20b's, MXFP4 experts, 8 of 24 layers (bench/lib/gguf_gpt_oss_model.py)
GEMMA4_SHAPE = "gemma4_e4b"  # Gemma 4 E4B's, 12 of 42 layers (bench/lib/gguf_gemma4.py)
# The shapes whose files have their own tensors and metadata: shape -> its maker under bench.lib.
OWN_MAKERS = {MLA_SHAPE: "gguf_mla_model", GEMMA4_SHAPE: "gguf_gemma4", GPT_OSS_SHAPE: "gguf_gpt_oss_model"}
FILE_TYPES = {
    "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "iq4_nl": gguf.LlamaFileType.MOSTLY_IQ4_NL,
    "iq4_xs": gguf.LlamaFileType.MOSTLY_IQ4_XS,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "mixed": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "q3_k_m": gguf.LlamaFileType.MOSTLY_Q3_K_M,
    "q2_k": gguf.LlamaFileType.MOSTLY_Q2_K,
}
_BASE_TYPE = {
    "q4_k_m": Q.Q4_K, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q8_0": Q.Q8_0, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1,
    "iq4_nl": Q.IQ4_NL, "iq4_xs": Q.IQ4_XS, "bf16": Q.BF16, "f16": Q.F16, "mixed": Q.Q4_K,
    "q3_k_m": Q.Q3_K, "q2_k": Q.Q2_K,
}  # fmt: skip
_MORE_BITS_ROLES = ("attn_v", "ffn_down", "ffn_down_exps")
_F32_ROLES = ("attn_norm", "attn_q_norm", "attn_k_norm", "ffn_norm", "ffn_gate_inp", "post_attention_norm",
              "post_ffw_norm")  # norms, router  # fmt: skip
# llama-quantize's fallback for a tensor whose rows are not whole 256-weight super-blocks; a row not
# whole 32-weight blocks of that then stays F16.
_FALLBACK = {
    Q.Q4_K: Q.Q5_0,
    Q.Q5_K: Q.Q5_1,
    Q.Q6_K: Q.Q8_0,
    Q.Q2_K: Q.IQ4_NL,
    Q.Q3_K: Q.IQ4_NL,
    Q.IQ4_XS: Q.IQ4_NL,
}
# ``mixed``: the Q4_K_M mix on the 1B shape with these roles taken as rows a multiple of 32 but not
# of 256 (as a model of hidden 576, 640, 896, ... has its attention): q/k/o Q5_0, v Q5_0 or Q8_0.
_MIXED_ODD_ROLES = ("attn_q", "attn_k", "attn_v", "attn_output")


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers whose v and down take Q6_K in a Q4_K_M file."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _low_bits_type(base: Q, role: str, layer: int, layers: int, gqa: int) -> Q:
    """llama-quantize's Q3_K_M and Q2_K mixes (dense models): v Q5_K in the first two layers then Q4_K
    (Q2_K: Q4_K where 4 or more query heads share a KV head, else Q3_K); down Q5_K in the first
    sixteenth then Q4_K (Q2_K: Q3_K); o Q4_K (Q2_K: Q3_K); the rest the base type."""
    if role == "attn_v":
        if base == Q.Q2_K:
            return Q.Q4_K if gqa >= 4 else Q.Q3_K
        return Q.Q5_K if layer < 2 else Q.Q4_K
    if role in ("ffn_down", "ffn_down_exps"):
        return Q.Q3_K if base == Q.Q2_K else Q.Q5_K if layer < layers // 16 else Q.Q4_K
    if role == "attn_output":
        return Q.Q3_K if base == Q.Q2_K else Q.Q4_K
    return base


def tensor_type(file_type: str, role: str, layer: int, layers: int, cols: int = 256, gqa: int = 1) -> Q:
    """The block type llama-quantize gives tensor ``role`` (attn_q, ffn_down_exps, output, ...) of
    ``cols`` weights a row in a model of ``gqa`` query heads per KV head; a tied embedding takes the
    output's. BF16 and F16 files: every weight in that type (the converter's, no quantizer)."""
    base = _BASE_TYPE[file_type]
    if base in (Q.BF16, Q.F16):
        return base
    qtype: Q = base
    if role == "output":  # Q6_K unless the file is Q8_0
        qtype = Q.Q8_0 if base == Q.Q8_0 else Q.Q6_K
    elif base == Q.Q4_K and role in _MORE_BITS_ROLES and more_bits(layer, layers):
        qtype = Q.Q6_K
    elif base in (Q.Q2_K, Q.Q3_K):
        qtype = _low_bits_type(base, role, layer, layers, gqa)
    elif base in (Q.IQ4_NL, Q.IQ4_XS) and role == "attn_v" and gqa >= 4:
        qtype = Q.Q5_K
    elif base in (Q.IQ4_NL, Q.IQ4_XS) and role in ("ffn_down", "ffn_down_exps") and layer < layers // 8:
        qtype = Q.Q5_K
    if cols % 256 or (file_type == "mixed" and role in _MIXED_ODD_ROLES):
        qtype = _FALLBACK.get(qtype, qtype)
    return qtype if cols % gguf.GGML_QUANT_SIZES[qtype][0] == 0 else Q.F16


Dims = tuple[int, ...]  # numpy's order: [experts,] rows, cols


def _tensors(shape: Shape, file_type: str) -> list[tuple[str, Q | None, Dims]]:
    """(GGUF name, block type or None for F32, dims) of every tensor, in llama.cpp's order. The F32
    ones are norms (one dim) and routers."""
    h, q, kv, n = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.layers
    embedding = tensor_type(file_type, "output" if shape.tied else "token_embd", 0, n, cols=h)
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
        layer += [("post_attention_norm", (h,))] if shape.post_norms else []
        layer += [("ffn_norm", (h,)), *([("ffn_gate_inp", (e, h))] if e else []), *ffn.items()]
        layer += [("post_ffw_norm", (h,))] if shape.post_norms else []
        gqa = shape.heads // shape.kv_heads
        out += [
            (
                f"blk.{i}.{role}.weight",
                None if role in _F32_ROLES else tensor_type(file_type, role, i, n, dims[-1], gqa),
                dims,
            )
            for role, dims in layer
        ]
    out.append(("output_norm.weight", None, (h,)))
    if not shape.tied:
        out.append(("output.weight", tensor_type(file_type, "output", 0, n, cols=h), (shape.vocab, h)))
    return out


def model_path(shape: Shape, file_type: str, root: Path | None = None) -> Path:
    folder = (cache_root() if root is None else root) / "bench-models"
    return folder / f"{shape.name}-shape-{file_type}-v{VERSION}.gguf"


# Per-token arrays padded to a vocabulary larger than the source's: unused tokens (llama.cpp checks
# the embedding's rows against the token count).
_PADDED = {"tokenizer.ggml.tokens": lambda i: f"<unused{i}>", "tokenizer.ggml.token_type": lambda i: 5,
           "tokenizer.ggml.scores": lambda i: 0.0}  # fmt: skip


def _copy_tokenizer(writer: gguf.GGUFWriter, source: Path, vocab: int) -> None:
    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if key in _PADDED and len(value) < vocab:
            value = [*value, *(_PADDED[key](i) for i in range(len(value), vocab))]
        writer.add_key_value(key, value, vtype, sub_type=sub)


def write_model(
    path: Path, shape: Shape, file_type: str, seed: int = 0, tokenizer: Path | None = None
) -> Path:
    """Write the GGUF (atomically: a temporary file renamed) and return ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), shape.arch)
    _add_metadata(writer, shape, file_type)
    _copy_tokenizer(writer, embedded_gguf_path() if tokenizer is None else tokenizer, shape.vocab)
    tensors = _tensors(shape, file_type)
    declare_tensors(writer, tensors)
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
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
        writer.add_rope_freq_base_swa(shape.local_rope_theta)
    writer.add_layer_norm_rms_eps(shape.eps)
    writer.add_file_type(int(FILE_TYPES[file_type]))
    writer.add_vocab_size(shape.vocab)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def ensure_model(name: str, root: Path | None = None) -> Path:
    """The path of bench model ``name`` (``llama1b-q4_k_m``, ``qwen3moe30b-q4_k_m``, ...), made
    first if it is not there."""
    shape_name, _, file_type = name.partition("-")
    if shape_name in OWN_MAKERS:
        maker = importlib.import_module(f"bench.lib.{OWN_MAKERS[shape_name]}")
        return Path(maker.ensure_model(file_type, root))
    if shape_name not in SHAPES or file_type not in FILE_TYPES:
        names = ", ".join(f"{s}-{t}" for s in SHAPES for t in FILE_TYPES)
        raise ValueError(f"no bench model {name!r}; one of {names}")
    shape = SHAPES[shape_name]
    path = model_path(shape, file_type, root)
    return path if path.is_file() else write_model(path, shape, file_type)


def resolve(model: str | None) -> str | None:
    """A ``--model`` argument with bench model names (``llama1b-q4_k_m``) replaced by their paths."""
    if (
        model is None
        or Path(model).expanduser().exists()
        or model.partition("-")[0] not in (*SHAPES, *OWN_MAKERS)
    ):
        return model
    return str(ensure_model(model))
