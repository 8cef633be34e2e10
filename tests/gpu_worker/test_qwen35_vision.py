"""Qwen3.5's vision tower (gpu_worker/models/qwen35_vision.py), loaded from a tiny random HF
checkpoint through vision.py, equals HF's Qwen3_5VisionModel in float64 on the pixels HF's own
image processor gives: image sizes of different grids (one not square), two images of one grid in
one batch. The 3D rope positions (gpu_worker/models/qwen35_positions.py) equal HF's get_rope_index
for prompts with images of different grids, and its rope_deltas for the decode steps after them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

PATCH, MERGE = 16, 2
SIZES = ((64, 96), (96, 64), (128, 128))  # (height, width): grids 4x6, 6x4, 8x8


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """A tiny Qwen3.5 VLM (float64, norms and biases perturbed) saved as transformers saves it."""
    out = tmp_path_factory.mktemp("qwen35_vlm")
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
                  num_position_embeddings=36, patch_size=PATCH, spatial_merge_size=MERGE)  # fmt: skip
    text = dict(vocab_size=300, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                     mrope_section=[1, 2, 1], mrope_interleaved=True))  # fmt: skip
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config).to(torch.float64).eval()
    with torch.no_grad():
        for name, param in model.model.visual.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            if name.startswith("pos_embed"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(out, safe_serialization=True)
    return out, model.model.visual, model.model


def _pixels(sizes: list[tuple[int, int]], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's image processor's pixel_values and image_grid_thw for random images of ``sizes``."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                                         min_pixels=32 * 32, max_pixels=256 * 256)  # fmt: skip
    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    out = processor(images=images, return_tensors="pt")
    return out["pixel_values"].to(torch.float64), out["image_grid_thw"]


def test_the_tower_is_loaded_to_serve(saved: tuple[Path, Any, Any]) -> None:
    from gpu_worker.image_encoder import image_encoder_for

    assert image_encoder_for(str(saved[0]), torch.float64, torch.device("cpu")) is not None


@pytest.mark.parametrize("size", SIZES)
def test_tower_equals_hf(saved: tuple[Path, Any, Any], size: tuple[int, int]) -> None:
    from gpu_worker.models.vision import load_vision_tower

    path, hf_visual, _ = saved
    tower = load_vision_tower(path, torch.float64, torch.device("cpu"))
    assert tower is not None
    pixels, grid = _pixels([size, size], seed=sum(size))
    (t, h, w) = grid[0].tolist()
    assert (h, w) == (size[0] // PATCH, size[1] // PATCH)
    with torch.no_grad():
        expected = hf_visual(pixels, grid_thw=grid).pooler_output.view(2, t * h * w // MERGE**2, -1)
        got = tower(pixels.view(2, t, h, w, -1))
    assert got.shape == expected.shape
    assert not torch.equal(got[0], got[1])  # two different images in one batch
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "layout",
    [
        [(3, (4, 6)), (5, (6, 4)), (2, (8, 8))],  # (text tokens before, patch grid h x w) per image
        [(0, (8, 8))],  # the prompt opens with an image
        [],
    ],
)
def test_positions_equal_hf_rope_index(saved: tuple[Path, Any, Any], layout: list[Any]) -> None:
    from gpu_worker.models.qwen35_positions import decode_positions, prompt_positions
    from protocol.images import ImageInput

    hf_model = saved[2]
    types: list[int] = []
    images, grids = [], []
    for key, (text, (h, w)) in enumerate(layout):
        types += [0] * text
        tokens = h * w // MERGE**2
        images.append(ImageInput(key=key, offset=len(types), length=tokens, shape=[1, h, w, 1], pixels=b""))
        grids.append([1, h, w])
        types += [1] * tokens
    types += [0] * 4  # text after the last image
    ids = torch.tensor([[7 + t for t in types]])
    expected, deltas = hf_model.get_rope_index(
        ids, torch.tensor([types]), image_grid_thw=torch.tensor(grids) if grids else None
    )
    got, delta = prompt_positions(len(types), images, MERGE)
    assert torch.equal(got, expected[:, 0])
    assert delta == int(deltas[0, 0])
    assert delta < 0 or not layout  # images make positions run behind indices
    chunk = slice(5, len(types))  # a prefill chunk starting mid-prompt reads its slice
    assert torch.equal(got[:, chunk], expected[0:3, 0, chunk])
    step = torch.tensor([len(types), len(types) + 1])
    assert torch.equal(decode_positions(step, delta), (step + deltas[0]).expand(3, -1))
    _check_mrope(hf_model, got)


def _check_mrope(hf_model: Any, positions: torch.Tensor) -> None:
    """The language model's rotation of ``positions`` equals HF's text rotary embedding's, bit for bit."""
    from gpu_worker.models.layers import RotaryCache
    from gpu_worker.models.qwen35_positions import mrope_axes, mrope_cos_sin

    rotary = hf_model.language_model.rotary_emb
    probe = torch.zeros(1, dtype=torch.float64)
    with torch.no_grad():
        cos, sin = rotary(probe, positions[:, None, :])
    half = cos.shape[-1] // 2
    torch.set_default_dtype(torch.float64)
    try:
        cache = RotaryCache(rotary.inv_freq, rotary.attention_scaling, 256)
    finally:
        torch.set_default_dtype(torch.float32)
    axes = mrope_axes(cos.shape[-1], rotary.mrope_section)
    assert axes.tolist() == [0, 1, 2, 0] * 2  # each axis rotates some columns
    got_cos, got_sin = mrope_cos_sin(cache, positions, rotary.mrope_section)
    assert torch.equal(got_cos[:, 0], cos[0])
    assert torch.equal(got_sin[:, 0, half:], sin[0, :, half:])
    assert torch.equal(got_sin[:, 0, :half], -sin[0, :, :half])


QWEN_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}


def test_processor_feeds_tower_and_positions(saved: tuple[Path, Any, Any], smollm2_dir: Path) -> None:
    """tokenizer_proc/qwen_processor.py over a prompt with two images of different grids: each run of
    image tokens as long as its grid's merged patches, the per-image pixels through the tower equal
    HF's image features, and the positions of its ids equal get_rope_index."""
    from PIL import Image

    from gpu_worker.models.qwen35_positions import prompt_positions
    from gpu_worker.models.vision import load_vision_tower
    from protocol.images import ImageInput
    from tokenizer_proc.images import ImageLimits, VisionProcessor, token_runs
    from tokenizer_proc.qwen_processor import qwen_processor

    path, _, hf_model = saved
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2, min_pixels=32 * 32,
                             max_pixels=256 * 256).save_pretrained(path)  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir, extra_special_tokens=QWEN_TOKENS)
    processor, token = qwen_processor(path, tokenizer)
    rng = np.random.default_rng(3)
    images = [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((64, 96), (128, 128))
    ]
    slot = "<|vision_start|><|image_pad|><|vision_end|>"
    out = processor(text=f"Look{slot} and{slot} twice", images=images)
    ids = out["input_ids"][0].tolist()
    runs = token_runs(ids, token)
    assert [length for _, length in runs] == [6, 16]  # grids 4x6 and 8x8 merged 2x2
    inputs = [
        ImageInput(key=i, offset=start, length=length, shape=list(px.shape), pixels=b"")
        for i, ((start, length), px) in enumerate(zip(runs, out["pixel_values"], strict=True))
    ]
    grids = torch.from_numpy(out["image_grid_thw"])
    flat = torch.cat([torch.from_numpy(px).reshape(-1, px.shape[-1]) for px in out["pixel_values"]]).double()
    tower = load_vision_tower(path, torch.float64, torch.device("cpu"))
    assert tower is not None
    with torch.no_grad():
        expected = hf_model.get_image_features(flat, grids).pooler_output
        for px, want in zip(out["pixel_values"], expected, strict=True):
            torch.testing.assert_close(
                tower(torch.from_numpy(px)[None].double())[0], want, rtol=1e-12, atol=1e-12
            )
    types = torch.tensor([[int(t == token) for t in ids]])
    want_positions, want_delta = hf_model.get_rope_index(torch.tensor([ids]), types, image_grid_thw=grids)
    positions, delta = prompt_positions(len(ids), inputs, MERGE)
    assert torch.equal(positions, want_positions[:, 0]) and delta == int(want_delta[0, 0])
    assert sum(processor.rope_delta(i.shape, i.length) for i in inputs) == delta
    vision = VisionProcessor.load(str(path), ImageLimits(), tokenizer)
    assert vision is not None and vision.image_token_id == token
