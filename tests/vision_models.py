"""A tiny random Gemma 3 vision-language model saved with its processor (SmolLM2's tokenizer with
Gemma 3's image tokens added, Gemma 3's image processor at 64x64, a Gemma-style chat template that
places an image's ``<start_of_image>``), and HF's greedy reference for it."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch

IMAGE_SIZE = 64  # pixels a side: 4x4 patches of 16, pooled 2x2 to 4 image tokens
TOKENS_PER_IMAGE = 4
IMAGE_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def save_tiny_gemma3_vlm(out: Path, smollm2_dir: Path) -> tuple[Any, Any]:
    """Save the model (float64, seed 0) and its processor to ``out``; return both."""
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir, extra_special_tokens=IMAGE_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = transformers.Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_length=TOKENS_PER_IMAGE,
        chat_template=CHAT_TEMPLATE,
    )  # fmt: skip
    processor.save_pretrained(out)
    config = transformers.Gemma3Config(
        text_config=_text_config(len(tokenizer)),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=IMAGE_SIZE, patch_size=16),
        mm_tokens_per_image=TOKENS_PER_IMAGE, image_token_index=tokenizer.image_token_id,
        boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model: Any = transformers.Gemma3ForConditionalGeneration(config)
    model = model.to(torch.float64).eval()
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: perturb so they are tested
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
        model.get_input_embeddings().weight.mul_(0.03)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out, safe_serialization=True)
    return model, processor


def _text_config(vocab: int) -> dict[str, Any]:
    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
    }
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                max_position_embeddings=1024, sliding_window=16, rope_parameters=rope,
                layer_types=["sliding_attention", "full_attention"])  # fmt: skip


def random_image(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def solid_image(rgb: tuple[int, int, int], height: int, width: int) -> np.ndarray:
    return np.broadcast_to(np.array(rgb, dtype=np.uint8), (height, width, 3)).copy()


def encoded(pixels: np.ndarray, fmt: str) -> bytes:
    """The image as a file of ``fmt`` (PNG, JPEG, WEBP, GIF)."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return out.getvalue()


def hf_greedy(
    model: Any, processor: Any, text: str, files: list[bytes], new_tokens: int
) -> tuple[list[int], list[int]]:
    """(prompt ids, HF's greedy output ids) for the rendered ``text`` and the image files, with the
    processor's token_type_ids: an image's tokens attend to each other both ways."""
    from PIL import Image

    images = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    inputs = processor(text=text, images=images or None, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt) :].tolist()


def write_gemma3_mmproj(model: Any, path: Path) -> None:
    """The model's vision tower as llama.cpp's converter writes it (convert_hf_to_gguf.py --mmproj
    --outtype f32): its names, ``clip.*`` metadata, the projection in F16, the soft-emb norm as
    ``1 + w``, the rest F32. Checked once against the converter of llama-cpp-python 0.3.36's sdist
    on this very model: the same tensors, types and values."""
    import gguf

    vision = model.config.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type("mmproj")
    writer.add_bool("clip.has_vision_encoder", True)
    for key, value in (
        ("image_size", vision.image_size),
        ("patch_size", vision.patch_size),
        ("embedding_length", vision.hidden_size),
        ("feed_forward_length", vision.intermediate_size),
        ("block_count", vision.num_hidden_layers),
        ("attention.head_count", vision.num_attention_heads),
        ("projection_dim", model.config.text_config.hidden_size),
    ):
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vision.layer_norm_eps)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_string("clip.projector_type", "gemma3")
    writer.add_bool("clip.use_gelu", True)
    per_side = int(model.config.mm_tokens_per_image**0.5)
    writer.add_uint32(
        "clip.vision.projector.scale_factor", vision.image_size // vision.patch_size // per_side
    )
    for name, tensor in _mmproj_tensors(model):
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _mmproj_tensors(model: Any) -> list[tuple[str, np.ndarray]]:
    parts = {
        "layer_norm1": "ln1",
        "layer_norm2": "ln2",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.out_proj": "attn_out",
        "mlp.fc1": "ffn_up",
        "mlp.fc2": "ffn_down",
    }
    out = []
    projector = model.model.multi_modal_projector
    out.append(
        (
            "mm.input_projection.weight",
            projector.mm_input_projection_weight.detach().numpy().astype(np.float16),
        )
    )
    norm = projector.mm_soft_emb_norm.weight.detach().numpy().astype(np.float32)
    out.append(("mm.soft_emb_norm.weight", norm + np.float32(1.0)))  # the converter adds the 1 in float32
    for name, param in model.model.vision_tower.named_parameters():
        name = name.removeprefix("vision_model.")
        if name.startswith("head."):
            continue
        gguf_name = {
            "embeddings.patch_embedding.weight": "v.patch_embd.weight",
            "embeddings.patch_embedding.bias": "v.patch_embd.bias",
            "embeddings.position_embedding.weight": "v.position_embd.weight",
            "post_layernorm.weight": "v.post_ln.weight",
            "post_layernorm.bias": "v.post_ln.bias",
        }.get(name)
        if gguf_name is None:
            _, _, block, rest = name.split(".", 3)  # encoder.layers.N.<part>.<kind>
            part, _, kind = rest.rpartition(".")
            gguf_name = f"v.blk.{block}.{parts[part]}.{kind}"
        out.append((gguf_name, param.detach().numpy().astype(np.float32)))
    return out
