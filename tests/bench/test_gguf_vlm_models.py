"""The image bench's files: the mmproj maker writes what rivulet's mmproj loader reads (llama.cpp's
converter's names and metadata), and the vocabulary holds Gemma 3's image tokens at Gemma's ids."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.lib.gguf_vlm_models import CONTROL, IMAGE_TOKENS, VisionShape, _padded, write_mmproj
from gpu_worker.weights.mmproj import load_mmproj_tower


def test_the_mmproj_loads_as_gemma3s_tower(tmp_path: Path) -> None:
    vision = VisionShape(
        hidden=32, layers=2, heads=2, ffn=64, image_size=112, patch_size=14, tokens_per_image=16
    )
    write_mmproj(tmp_path / "mmproj.gguf", vision, text_hidden=48)
    tower = load_mmproj_tower(tmp_path / "mmproj.gguf", torch.float32, torch.device("cpu"))
    assert tower.tokens_per_image == 16
    out = tower(torch.zeros(2, 3, 112, 112))
    assert out.shape == (2, 16, 48) and torch.isfinite(out).all()


def test_the_vocabulary_has_the_image_tokens_at_gemmas_ids() -> None:
    tokens = _padded("tokenizer.ggml.tokens", ["a", "b"], 262208)
    types = _padded("tokenizer.ggml.token_type", [1, 1], 262208)
    assert len(tokens) == 262208 and tokens[:2] == ["a", "b"] and tokens[7] == "<unused7>"
    for token_id, text in IMAGE_TOKENS.items():
        assert tokens[token_id] == text and types[token_id] == CONTROL
