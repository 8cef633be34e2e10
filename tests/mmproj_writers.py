"""Gemma 4's and Qwen3.5's vision towers written as llama.cpp's converter writes their ``mmproj``
GGUFs (``convert_hf_to_gguf.py --mmproj --outtype f32``; conversion/gemma.py's
Gemma4VisionAudioModel and conversion/qwen3vl.py's Qwen3VLVisionModel in llama-cpp-python 0.3.36's
sdist), with names from the ``gguf`` package's own HF -> GGUF map (not from the reader under test)
and the converter's changes made as it makes them: Gemma 4's patch embedder as a conv kernel
[out, channel, row, column] and its scalar bounds as [1]; Qwen's Conv3d patch embedding split into
its two temporal halves, its merger as ``mm.0`` / ``mm.2`` / ``v.post_ln``. Everything F32, as that
outtype writes it, so HF's tower holds the file's weights after ``rounded_to_float32``. Checked once
against that converter on the tiny models below: the same metadata, tensor names, types and values.

Also a tiny random Qwen3.5 vision-language model (tests/exactness/test_qwen35_images.py's shape).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

BOUNDS = (".weight", ".bias", ".input_max", ".input_min", ".output_max", ".output_min")


def _writer(path: Path, model: Any, processor_config: dict[str, Any], image_size: int) -> gguf.GGUFWriter:
    """A ``clip`` GGUF with the metadata every mmproj has (MmprojModel's)."""
    vision = model.config.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type("mmproj")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_bool("clip.has_vision_encoder", True)
    heads = getattr(vision, "num_attention_heads", None) or vision.num_heads
    layers = getattr(vision, "num_hidden_layers", None) or vision.depth
    for key, value in (
        ("projection_dim", model.config.get_text_config().hidden_size),
        ("image_size", image_size),
        ("patch_size", vision.patch_size),
        ("embedding_length", vision.hidden_size),
        ("feed_forward_length", vision.intermediate_size),
        ("block_count", layers),
        ("attention.head_count", heads),
    ):
        writer.add_uint32(f"clip.vision.{key}", int(value))
    writer.add_array("clip.vision.image_mean", [float(x) for x in processor_config["image_mean"]])
    writer.add_array("clip.vision.image_std", [float(x) for x in processor_config["image_std"]])
    return writer


def _close(writer: gguf.GGUFWriter, tensors: Iterator[tuple[str, np.ndarray]]) -> None:
    for name, data in tensors:
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _mapped(names: gguf.TensorNameMap, name: str) -> str:
    mapped = names.get_name(name, try_suffixes=BOUNDS)
    assert mapped is not None, f"gguf names no {name}"
    return mapped


def write_gemma4_mmproj(model: Any, image_processor: Any, path: Path) -> None:
    """A Gemma4ForConditionalGeneration's vision tower and projector as a ``gemma4v`` mmproj."""
    vision = model.config.vision_config
    writer = _writer(path, model, image_processor.to_dict(), 224)  # the converter's "unused" size
    writer.add_string("clip.vision.projector_type", "gemma4v")  # its converter, which may add audio
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", getattr(vision, "layer_norm_eps", 1e-6))
    _close(writer, _gemma4_tensors(model))


def _gemma4_tensors(model: Any) -> Iterator[tuple[str, np.ndarray]]:
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, model.config.vision_config.num_hidden_layers)
    for key, tensor in model.state_dict().items():
        if not key.startswith(("model.vision_tower.", "model.embed_vision.")):
            continue
        data = tensor.float().numpy()
        name = key.replace("model.vision_tower.encoder.", "vision_model.model.").replace(
            ".linear.weight", ".weight"
        )
        if name.endswith("position_embedding_table"):
            name += ".weight"
        if data.ndim == 0:
            data = data.reshape(1)
        if name.endswith("patch_embedder.input_proj.weight"):
            patch = model.config.vision_config.patch_size
            data = data.reshape(data.shape[0], patch, patch, 3).transpose(0, 3, 1, 2)
        yield _mapped(names, name), data


def write_qwen35_mmproj(model: Any, image_processor: Any, path: Path) -> None:
    """A Qwen3_5ForConditionalGeneration's vision tower and merger as a ``qwen3vl_merger`` mmproj."""
    vision = model.config.vision_config
    side = int(vision.num_position_embeddings**0.5)  # the converter's size: the position grid's
    writer = _writer(path, model, image_processor.to_dict(), side * vision.patch_size)
    writer.add_string("clip.projector_type", "qwen3vl_merger")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.spatial_merge_size", vision.spatial_merge_size)
    eps = getattr(model.config.get_text_config(), "rms_norm_eps", 1e-6)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", eps)
    deepstack = set(getattr(vision, "deepstack_visual_indexes", None) or [])
    writer.add_array("clip.vision.is_deepstack_layers", [i in deepstack for i in range(vision.depth)])
    _close(writer, _qwen35_tensors(model))


def _qwen35_tensors(model: Any) -> Iterator[tuple[str, np.ndarray]]:
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, model.config.vision_config.depth)
    merger = {"linear_fc1": "mm.0", "linear_fc2": "mm.2", "norm": "v.post_ln"}
    for key, tensor in model.state_dict().items():
        if not key.startswith("model.visual."):
            continue
        name, data = key.replace("model.visual.", "visual.", 1), tensor.float().numpy()
        if name == "visual.patch_embed.proj.weight":  # [out, in, 2, p, p]: a kernel per frame
            yield "v.patch_embd.weight", data[:, :, 0]
            yield "v.patch_embd.weight.1", data[:, :, 1]
        elif name.startswith("visual.merger."):
            part, kind = name.removeprefix("visual.merger.").split(".")
            yield f"{merger[part]}.{kind}", data
        else:
            yield _mapped(names, name), data


def rounded_to_float32(module: torch.nn.Module) -> None:
    """``module``'s parameters and buffers holding what an F32 file holds."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_floating_point():
                tensor.copy_(tensor.float().double())


QWEN_PATCH, QWEN_MERGE, QWEN_IMAGE, QWEN_START, QWEN_END = 16, 2, 299, 298, 297


def save_tiny_qwen35_vlm(out: Path, seed: int = 0) -> tuple[Any, Any]:
    """A tiny Qwen3.5 VLM (one linear and one full-attention layer, float64) and its image processor,
    both saved to ``out``."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
                  num_position_embeddings=36, patch_size=QWEN_PATCH,
                  spatial_merge_size=QWEN_MERGE)  # fmt: skip
    text = dict(vocab_size=300, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                layer_types=["linear_attention", "full_attention"], num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                linear_key_head_dim=8, linear_value_head_dim=8,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                     mrope_section=[1, 2, 1], mrope_interleaved=True))  # fmt: skip
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision,
                                        image_token_id=QWEN_IMAGE, vision_start_token_id=QWEN_START,
                                        vision_end_token_id=QWEN_END)  # fmt: skip
    torch.manual_seed(seed)
    model: Any = transformers.Qwen3_5ForConditionalGeneration(config)
    model = model.to(torch.float64).eval()
    with torch.no_grad():
        for name, param in model.model.visual.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
        model.model.language_model.embed_tokens.weight.normal_(0.0, 1.0)
    model.save_pretrained(out, safe_serialization=True)
    processor = Qwen2VLImageProcessorPil(patch_size=QWEN_PATCH, merge_size=QWEN_MERGE, temporal_patch_size=2,
                                         min_pixels=32 * 32, max_pixels=256 * 256)  # fmt: skip
    processor.save_pretrained(out)
    return model, processor
