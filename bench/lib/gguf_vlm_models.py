"""A Gemma-3-4B-shaped GGUF and its vision tower as llama.cpp's mmproj GGUF, for the image benches
(bench/images.py), both with random weights.

The language model is bench/lib/gguf_models.py's writer on Gemma 3 4B's shape (hidden 2560, 34
layers, 8 query / 4 KV heads of 256, FFN 10240, 5 of every 6 layers on a 1024-token window, a
262208-token vocabulary, tied). Its vocabulary is SmolLM2's, padded with unused tokens, and Gemma 3's
three image tokens at Gemma's ids (``<start_of_image>`` 255999, ``<end_of_image>`` 256000,
``<image_soft_token>`` 262144) as control tokens, with a Gemma-style chat template that places an
image's ``<start_of_image>``: so rivulet (which builds the processor from the mmproj, --mmproj) and
llama-server (``--mmproj``) read the same prompt. The mmproj is SigLIP-So400m's shape as Gemma 3
has it (hidden 1152, 27 layers, 16 heads, FFN 4304, 896x896 images in 14x14 patches, pooled 4x4 to
256 tokens), named, typed and described as llama.cpp's converter writes it (F16 matrices and
projection, F32 norms, biases and embeddings; the soft-emb norm as ``1 + w``). Files go where
gguf_models.py puts its own, named by shape and ``VERSION``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from bench.lib.gguf_models import Shape, model_path, write_model
from gpu_worker.weights.model_files import embedded_gguf_path

VERSION = 1
IMAGE_TOKENS = {255999: "<start_of_image>", 256000: "<end_of_image>", 262144: "<image_soft_token>"}
CONTROL = 3  # llama.cpp's token type of a special token
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA3_4B = Shape(
    "gemma3_4b", hidden=2560, layers=34, heads=8, kv_heads=4, ffn=10240, vocab=262208, context=32768,
    rope_theta=1e6, eps=1e-6, arch="gemma3", key_length=256, sliding_window=1024, local_rope_theta=10000.0,
)  # fmt: skip


@dataclass(frozen=True)
class VisionShape:
    hidden: int = 1152
    layers: int = 27
    heads: int = 16
    ffn: int = 4304
    image_size: int = 896
    patch_size: int = 14
    tokens_per_image: int = 256


SIGLIP_SO400M = VisionShape()


def ensure_vlm(file_type: str = "q4_k_m", root: Path | None = None) -> tuple[Path, Path]:
    """(the language model's GGUF, its mmproj), made first where missing."""
    return write_vlm(GEMMA3_4B, SIGLIP_SO400M, file_type, root)


def write_vlm(
    shape: Shape, vision: VisionShape, file_type: str, root: Path | None = None
) -> tuple[Path, Path]:
    text = model_path(shape, file_type, root).with_name(f"{shape.name}-vlm-shape-{file_type}-v{VERSION}.gguf")
    mmproj = text.with_name(f"{shape.name}-mmproj-shape-f16-v{VERSION}.gguf")
    text.parent.mkdir(parents=True, exist_ok=True)
    if not text.is_file():
        tokenizer = text.with_name(f".{shape.name}-tokenizer-{os.getpid()}.gguf")
        write_tokenizer(tokenizer, shape.vocab)
        try:
            write_model(text, shape, file_type, tokenizer=tokenizer)
        finally:
            tokenizer.unlink(missing_ok=True)
    if not mmproj.is_file():
        write_mmproj(mmproj, vision, shape.hidden)
    return text, mmproj


def write_tokenizer(path: Path, vocab: int) -> None:
    """A GGUF of ``tokenizer.*`` fields alone: SmolLM2's, padded to ``vocab``, Gemma 3's image
    tokens at Gemma's ids, the chat template above."""
    reader = gguf.GGUFReader(str(embedded_gguf_path()))
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.") or key == "tokenizer.chat_template":
            continue
        vtype = field.types[0]
        value = field.contents()
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            value = _padded(key, list(value), vocab)
        writer.add_key_value(
            key, value, vtype, sub_type=field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        )
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def _padded(key: str, value: list[object], vocab: int) -> list[object]:
    fill = {"tokenizer.ggml.tokens": lambda i: IMAGE_TOKENS.get(i, f"<unused{i}>"),
            "tokenizer.ggml.token_type": lambda i: CONTROL if i in IMAGE_TOKENS else 5,
            "tokenizer.ggml.scores": lambda i: 0.0}[key]  # fmt: skip
    return [*value, *(fill(i) for i in range(len(value), vocab))]


def write_mmproj(path: Path, vision: VisionShape, text_hidden: int, seed: int = 1) -> None:
    """The tower as the converter writes Gemma 3's (``convert_hf_to_gguf.py --mmproj``, F16)."""
    rng = np.random.default_rng(seed)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), "clip")
    writer.add_type("mmproj")
    writer.add_bool("clip.has_vision_encoder", True)
    for key, value in (("image_size", vision.image_size), ("patch_size", vision.patch_size),
                       ("embedding_length", vision.hidden), ("feed_forward_length", vision.ffn),
                       ("block_count", vision.layers), ("attention.head_count", vision.heads),
                       ("projection_dim", text_hidden)):  # fmt: skip
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_string("clip.projector_type", "gemma3")
    writer.add_bool("clip.use_gelu", True)
    per_side = int(vision.tokens_per_image**0.5)
    if vision.image_size // vision.patch_size // per_side != 4:
        writer.add_uint32(
            "clip.vision.projector.scale_factor", vision.image_size // vision.patch_size // per_side
        )
    for name, data in _mmproj_tensors(vision, text_hidden, rng):
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)


def _mmproj_tensors(
    vision: VisionShape, text_hidden: int, rng: np.random.Generator
) -> list[tuple[str, np.ndarray]]:
    h, f, p = vision.hidden, vision.ffn, vision.patch_size
    patches = (vision.image_size // p) ** 2

    def matrix(*dims: int) -> np.ndarray:
        return rng.normal(0.0, 0.02, size=dims).astype(np.float16)

    def vector(n: int, mean: float = 0.0) -> np.ndarray:
        return (mean + rng.normal(0.0, 0.02, size=n)).astype(np.float32)

    out = [
        ("mm.input_projection.weight", matrix(h, text_hidden)),
        ("mm.soft_emb_norm.weight", vector(h, 1.0)),
        ("v.patch_embd.weight", rng.normal(0.0, 0.02, size=(h, 3, p, p)).astype(np.float32)),
        ("v.patch_embd.bias", vector(h)),
        ("v.position_embd.weight", vector(patches * h).reshape(patches, h)),
        ("v.post_ln.weight", vector(h, 1.0)),
        ("v.post_ln.bias", vector(h)),
    ]
    for i in range(vision.layers):
        for part, rows, cols in (("attn_q", h, h), ("attn_k", h, h), ("attn_v", h, h), ("attn_out", h, h),
                                 ("ffn_up", f, h), ("ffn_down", h, f)):  # fmt: skip
            out += [
                (f"v.blk.{i}.{part}.weight", matrix(rows, cols)),
                (f"v.blk.{i}.{part}.bias", vector(rows)),
            ]
        for norm in ("ln1", "ln2"):
            out += [(f"v.blk.{i}.{norm}.weight", vector(h, 1.0)), (f"v.blk.{i}.{norm}.bias", vector(h))]
    return out
