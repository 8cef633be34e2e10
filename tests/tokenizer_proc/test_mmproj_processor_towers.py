"""A GGUF model's image processor built from a Gemma 4 (``gemma4v``) or Qwen3.5 (``qwen3vl_merger``)
mmproj file's metadata gives what HF's processor with the released checkpoints' settings gives: the
same token ids (the placeholder expanded alike) and the same pixels; a directory without a processor
takes it from the file."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from PIL import Image

from tests.gemma4_vision_models import MEDIA_TOKENS, hf_processor
from tests.gpu_worker.test_qwen35_vision import QWEN_TOKENS
from tests.vision_models import random_image, solid_image
from tokenizer_proc.images import ImageLimits, VisionProcessor
from tokenizer_proc.mmproj_processor import GEMMA4_TOKENS, QWEN35_PIXELS, mmproj_processor


def metadata_only(path: Path, projector: str, patch: int, mean: float, std: float, **more: int) -> Path:
    """An mmproj file's ``clip.*`` metadata, as the converter writes it (the processor reads no tensor)."""
    writer = gguf.GGUFWriter(str(path), "clip")
    # Gemma 4's converter, which may add an audio tower, names the vision projector under clip.vision.
    writer.add_string(
        "clip.vision.projector_type" if projector == "gemma4v" else "clip.projector_type", projector
    )
    writer.add_uint32("clip.vision.patch_size", patch)
    writer.add_array("clip.vision.image_mean", [mean] * 3)
    writer.add_array("clip.vision.image_std", [std] * 3)
    for key, value in more.items():
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def tokenizer_with(smollm2_dir: Path, tokens: dict[str, str]) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(smollm2_dir, extra_special_tokens=tokens)


@pytest.fixture(scope="module")
def gemma4_tokenizer(smollm2_dir: Path) -> Any:
    return tokenizer_with(smollm2_dir, MEDIA_TOKENS)


@pytest.fixture(scope="module")
def qwen_tokenizer(smollm2_dir: Path) -> Any:
    return tokenizer_with(smollm2_dir, QWEN_TOKENS)


IMAGES = [Image.fromarray(random_image(1, 50, 70)), Image.fromarray(solid_image((9, 200, 30), 90, 40))]


def test_gemma4(gemma4_tokenizer: Any, tmp_path: Path) -> None:
    tokenizer = gemma4_tokenizer
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    file = metadata_only(tmp_path / "g4.gguf", "gemma4v", 4, 0.0, 1.0)
    ours, image_token = mmproj_processor(str(file), tokenizer)
    assert image_token == tokenizer.convert_tokens_to_ids(GEMMA4_TOKENS[0])
    hf = hf_processor(Gemma4ImageProcessorPil(patch_size=4), tokenizer)  # the default 280-token budget
    text = "<start_of_turn>user\nA <|image|> and <|image|>?<end_of_turn>\n"
    want = hf(text=text, images=IMAGES, return_tensors="np", add_special_tokens=False)
    got = ours(text=text, images=IMAGES, return_tensors="np", add_special_tokens=False)
    assert got["input_ids"].tolist() == want["input_ids"].tolist()
    assert np.array_equal(got["pixel_values"], want["pixel_values"])
    assert np.array_equal(got["image_position_ids"], want["image_position_ids"])
    assert got["input_ids"].tolist()[0].count(image_token) > 70, "more than the tiny test model's budget"


def test_qwen35(qwen_tokenizer: Any, tmp_path: Path) -> None:
    tokenizer = qwen_tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    file = metadata_only(tmp_path / "q.gguf", "qwen3vl_merger", 16, 0.5, 0.5, spatial_merge_size=2)
    ours, image_token = mmproj_processor(str(file), tokenizer)
    assert image_token == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    hf = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, size=QWEN35_PIXELS,
                                  image_mean=[0.5] * 3, image_std=[0.5] * 3)  # fmt: skip
    want = hf(IMAGES, return_tensors="np")
    slot = "<|vision_start|><|image_pad|><|vision_end|>"
    got = ours(text=f"Look{slot} and{slot}", images=IMAGES)
    grids = want["image_grid_thw"]
    assert np.array_equal(got["image_grid_thw"], grids)
    assert np.array_equal(np.concatenate([p.reshape(-1, p.shape[-1]) for p in got["pixel_values"]]),
                          want["pixel_values"])  # fmt: skip
    runs = [int(t * h * w) // 4 for t, h, w in grids]
    assert got["input_ids"][0].tolist().count(image_token) == sum(runs)


def test_a_directory_without_a_processor_takes_it_from_the_file(qwen_tokenizer: Any, tmp_path: Path) -> None:
    tokenizer = qwen_tokenizer
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    file = metadata_only(tmp_path / "q.gguf", "qwen3vl_merger", 16, 0.5, 0.5, spatial_merge_size=2)
    vision = VisionProcessor.load(str(tmp_path), ImageLimits(), tokenizer, str(file))
    assert vision is not None
    png = io.BytesIO()
    Image.fromarray(solid_image((1, 2, 3), 300, 260)).save(png, format="PNG")
    from protocol.chat import ChatMessage, ImagePart

    messages = [ChatMessage(role="user", parts=[ImagePart(data=png.getvalue())])]
    ids, images = vision.prompt("<|vision_start|><|image_pad|><|vision_end|>", messages)
    (image,) = images
    assert image.shape[:3] == [1, 18, 16] and image.length == 18 * 16 // 4 == ids.count(vision.image_token_id)
    assert image.rope_delta == 18 // 2 - image.length, "Qwen's 3D positions: the merged grid's longer side"
    with pytest.raises(ValueError, match="projector type 'llava'"):
        mmproj_processor(str(metadata_only(tmp_path / "l.gguf", "llava", 14, 0.5, 0.5)), tokenizer)
