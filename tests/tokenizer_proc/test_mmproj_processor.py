"""A GGUF model's image processor built from its mmproj file gives what HF's Gemma3Processor gives:
the same token ids (the placeholder expanded alike) and the same pixels."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.vision_models import random_image, save_tiny_gemma3_vlm, solid_image, write_gemma3_mmproj
from tokenizer_proc.images import ImageLimits, VisionProcessor
from tokenizer_proc.mmproj_processor import mmproj_processor


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> tuple[Any, Path]:
    out = tmp_path_factory.mktemp("gemma3-vlm")
    model, processor = save_tiny_gemma3_vlm(out, smollm2_dir)
    write_gemma3_mmproj(model, out / "mmproj.gguf")
    return processor, out / "mmproj.gguf"


def test_the_same_ids_and_pixels_as_hfs_processor(vlm: tuple[Any, Path]) -> None:
    hf, mmproj = vlm
    ours, image_token = mmproj_processor(str(mmproj), hf.tokenizer)
    assert image_token == hf.tokenizer.image_token_id
    images = [Image.fromarray(random_image(1, 50, 70)), Image.fromarray(solid_image((9, 200, 30), 90, 20))]
    text = "<start_of_turn>user\nA <start_of_image> and <start_of_image>?<end_of_turn>\n"
    want = hf(text=text, images=images, return_tensors="np", add_special_tokens=False)
    got = ours(text=text, images=images, return_tensors="np", add_special_tokens=False)
    assert got["input_ids"].tolist() == want["input_ids"].tolist()
    assert np.array_equal(got["pixel_values"], want["pixel_values"])
    with pytest.raises(ValueError, match="places 1 images for 2"):
        ours(text="<start_of_image>", images=images)


def test_a_directory_without_a_processor_takes_it_from_mmproj(vlm: tuple[Any, Path], tmp_path: Path) -> None:
    hf, mmproj = vlm
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    assert VisionProcessor.load(str(tmp_path), ImageLimits(), hf.tokenizer) is None, "no mmproj: text only"
    vision = VisionProcessor.load(str(tmp_path), ImageLimits(), hf.tokenizer, str(mmproj))
    assert vision is not None and vision.image_token_id == hf.tokenizer.image_token_id
    png = io.BytesIO()
    Image.fromarray(solid_image((1, 2, 3), 8, 8)).save(png, format="PNG")
    from protocol.chat import ChatMessage, ImagePart

    messages = [ChatMessage(role="user", parts=[ImagePart(data=png.getvalue())])]
    ids, images = vision.prompt("<start_of_image>", messages)
    image_token = hf.tokenizer.image_token_id
    assert [(i.offset, i.length) for i in images] == [(ids.index(image_token), 4)]
    assert ids.count(image_token) == 4 and ids[ids.index(image_token) - 1] == hf.tokenizer.boi_token_id
