"""A tiny random Gemma 4 vision-language model: its tower equal to HF's image features, and served
end to end (images in chat messages over ZMQ), token for token against HF transformers in float64
given the same images (random pixels and solid colours, aspect ratios that give different grids).

One engine for the module, chunks of 64 tokens and pages of 4: a chunk ends before an image it would
cut, so each image's tokens (60 or 63 here) are computed in one forward. The text config's
``use_bidirectional_attention`` is "vision": HF's mask lets an image's tokens see each other both ways
on the sliding layers (its global layers stay causal), and HF is given the processor's
mm_token_type_ids; on one prompt at least the causal mask gives other tokens.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.exactness.test_gemma3_vision import Parts, served, user_turn
from tests.gemma4_vision_models import save_tiny_gemma4_vlm
from tests.tokenizer_proc.http.server import HttpEngine, http_engine
from tests.vision_models import encoded, hf_greedy, random_image, solid_image

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> tuple[Path, Any, Any]:
    out = tmp_path_factory.mktemp("gemma4-vlm")
    model, processor = save_tiny_gemma4_vlm(out, smollm2_dir)
    return out, model, processor


@pytest.fixture(scope="module")
def engine(vlm: tuple[Path, Any, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpEngine]:
    args = ("--dtype", "float64", "--chunked-prefill-size", "64", "--page-size", "4")
    with http_engine(vlm[0], tmp_path_factory.mktemp("vlm4-engine"), *args) as e:
        yield e


def expected(vlm: tuple[Path, Any, Any], parts: Parts, causal: bool = False) -> list[int]:
    """HF's greedy tokens (``causal``: without mm_token_type_ids, so image tokens attend causally)."""
    _, model, processor = vlm
    _, template = user_turn(parts)
    text = processor.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    files = [v for k, v in parts if k == "image" and isinstance(v, bytes)]
    if not causal:
        return hf_greedy(model, processor, text, files, NEW_TOKENS)[1]
    images = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    inputs = processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    inputs.pop("mm_token_type_ids")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_tower_equals_hf_image_features(vlm: tuple[Path, Any, Any]) -> None:
    from gpu_worker.models.vision import load_vision_tower

    path, model, processor = vlm
    tower = load_vision_tower(path, torch.float64, torch.device("cpu"))
    assert tower is not None
    images = [Image.fromarray(random_image(0, 50, 70)), Image.fromarray(solid_image((10, 30, 200), 40, 90))]
    out = processor.image_processor(images, return_tensors="pt")
    with torch.no_grad():
        want = model.model.get_image_features(out["pixel_values"], out["image_position_ids"]).pooler_output
        pixels = torch.cat([out["pixel_values"].float(), out["image_position_ids"].float()], dim=-1)
        got = tower(pixels.double())
    assert [g.shape[0] for g in got] == list(out["num_soft_tokens_per_image"]) == [63, 60]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


RANDOM_PNG = encoded(random_image(0, 50, 70), "PNG")
RED_JPEG = encoded(solid_image((220, 20, 20), 64, 64), "JPEG")
BLUE_GIF = encoded(solid_image((10, 30, 200), 40, 90), "GIF")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "parts",
    [
        [("text", "Describe "), ("image", RANDOM_PNG), ("text", " please.")],
        [("image", RED_JPEG), ("text", "and"), ("image", BLUE_GIF), ("text", "which is brighter?")],
    ],
    ids=["random-png", "jpeg-and-gif"],
)
def test_images_match_hf(vlm: tuple[Path, Any, Any], engine: HttpEngine, parts: Parts) -> None:
    want = expected(vlm, parts)
    got, _ = served(engine, parts)
    assert got == want


def test_the_two_way_mask_changes_an_answer(vlm: tuple[Path, Any, Any]) -> None:
    parts: Parts = [("image", RED_JPEG), ("text", "and"), ("image", BLUE_GIF), ("text", "which is brighter?")]
    assert expected(vlm, parts) != expected(vlm, parts, causal=True), "the test needs the masks told apart"


@pytest.mark.timeout(600)
def test_another_image_gives_another_answer(vlm: tuple[Path, Any, Any], engine: HttpEngine) -> None:
    question = "What is in this picture?"
    first: Parts = [("text", question), ("image", encoded(random_image(11, 64, 64), "PNG"))]
    other: Parts = [("text", question), ("image", encoded(np.zeros((64, 64, 3), np.uint8), "PNG"))]
    want_first, want_other = expected(vlm, first), expected(vlm, other)
    assert want_first != want_other, "the test needs images the model tells apart"
    assert (served(engine, first)[0], served(engine, other)[0]) == (want_first, want_other)


def test_tower_with_clipped_linears_and_standardization(tmp_path: Path, smollm2_dir: Path) -> None:
    """The options the tiny model leaves off: each linear's input and output clamped to the
    checkpoint's bounds, and the pooled tokens standardized by its bias and scale."""
    from gpu_worker.models.vision import load_vision_tower

    vision = {"use_clipped_linears": True, "standardize": True}
    model, processor = save_tiny_gemma4_vlm(tmp_path, smollm2_dir, vision=vision, bounds=0.5)
    tower = load_vision_tower(tmp_path, torch.float64, torch.device("cpu"))
    assert tower is not None
    out = processor.image_processor([Image.fromarray(random_image(5, 70, 40))], return_tensors="pt")
    with torch.no_grad():
        want = model.model.get_image_features(out["pixel_values"], out["image_position_ids"]).pooler_output
        pixels = torch.cat([out["pixel_values"].float(), out["image_position_ids"].float()], dim=-1)
        got = tower(pixels.double())
    assert torch.equal(got[0], want[0])
