"""Gemma 4's and Qwen3.5's vision towers read from llama.cpp mmproj GGUFs (written as its converter
writes them: tests/mmproj_writers.py) equal HF's image features given the weights the files hold."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from PIL import Image

from gpu_worker.weights.mmproj import load_mmproj_tower
from gpu_worker.weights.mmproj_towers import gemma4_name, qwen35_name
from tests.gemma4_vision_models import save_tiny_gemma4_vlm
from tests.mmproj_writers import (
    rounded_to_float32,
    save_tiny_qwen35_vlm,
    write_gemma4_mmproj,
    write_qwen35_mmproj,
)
from tests.vision_models import random_image, solid_image

CPU = torch.device("cpu")


def test_gemma4_tower_with_its_options(tmp_path: Path, smollm2_dir: Path) -> None:
    """Clipped linears (bounds that bite), standardization and a key/value head shared by two query
    heads: all read back from the file, the tower equal to HF's."""
    vision = {"use_clipped_linears": True, "standardize": True}
    model, processor = save_tiny_gemma4_vlm(tmp_path, smollm2_dir, vision=vision, bounds=0.5)
    write_gemma4_mmproj(model, processor.image_processor, tmp_path / "mmproj.gguf")
    rounded_to_float32(model.model.vision_tower)
    rounded_to_float32(model.model.embed_vision)
    tower: Any = load_mmproj_tower(tmp_path / "mmproj.gguf", torch.float64, CPU, model.config)
    cfg = tower.vision_tower.cfg
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.position_embedding_size) == (1, 16, 64)
    assert cfg.use_clipped_linears and cfg.standardize and tower.bidirectional
    images = [Image.fromarray(random_image(0, 50, 70)), Image.fromarray(solid_image((10, 30, 200), 40, 90))]
    out = processor.image_processor(images, return_tensors="pt")
    with torch.no_grad():
        want = model.model.get_image_features(out["pixel_values"], out["image_position_ids"]).pooler_output
        pixels = torch.cat([out["pixel_values"].float(), out["image_position_ids"].float()], dim=-1)
        got = tower(pixels.double())
    assert [g.shape[0] for g in got] == [63, 60]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_qwen35_tower(tmp_path: Path) -> None:
    model, image_processor = save_tiny_qwen35_vlm(tmp_path)
    write_qwen35_mmproj(model, image_processor, tmp_path / "mmproj.gguf")
    names = [t.name for t in gguf.GGUFReader(str(tmp_path / "mmproj.gguf")).tensors]
    assert {"v.patch_embd.weight", "v.patch_embd.weight.1", "mm.0.weight", "v.blk.1.attn_qkv.bias"} <= set(
        names
    )
    rounded_to_float32(model.model.visual)
    tower: Any = load_mmproj_tower(tmp_path / "mmproj.gguf", torch.float64, CPU)
    rng = np.random.default_rng(3)
    images = [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((64, 96), (96, 64))
    ]
    out = image_processor(images, return_tensors="np")
    grids = torch.from_numpy(out["image_grid_thw"])
    flat = torch.from_numpy(out["pixel_values"]).double()
    with torch.no_grad():
        want = model.model.get_image_features(flat, grids).pooler_output
        start = 0
        for (t, h, w), expected in zip(grids.tolist(), want, strict=True):
            px = flat[start : start + t * h * w].reshape(1, t, h, w, -1)
            start += t * h * w
            torch.testing.assert_close(tower(px)[0], expected, rtol=1e-12, atol=1e-12)


def test_names() -> None:
    assert (
        gemma4_name("v.blk.1.attn_q.weight") == "vision_tower.encoder.layers.1.self_attn.q_proj.linear.weight"
    )
    assert (
        gemma4_name("v.blk.0.ffn_down.output_max") == "vision_tower.encoder.layers.0.mlp.down_proj.output_max"
    )
    assert (
        gemma4_name("v.blk.0.attn_post_norm.weight")
        == "vision_tower.encoder.layers.0.post_attention_layernorm.weight"
    )
    assert gemma4_name("v.blk.0.layer_scalar.weight") is None
    assert qwen35_name("v.blk.2.attn_qkv.bias") == "visual.blocks.2.attn.qkv.bias"
    assert qwen35_name("v.deepstack.5.fc1.weight") is None, "Qwen3-VL's deep stack is not Qwen3.5's"
    assert qwen35_name("mm.2.weight") == "visual.merger.linear_fc2.weight"


def test_a_file_of_another_projector_is_refused(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "clip")
    writer.add_string("clip.projector_type", "qwen2vl_merger")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'qwen2vl_merger' is not supported"):
        load_mmproj_tower(tmp_path / "other.gguf", torch.float64, CPU)


def test_the_launcher_admits_the_projectors_the_worker_reads() -> None:
    from gpu_worker.weights.mmproj import SUPPORTED
    from launcher_checks import MMPROJ_PROJECTORS

    assert MMPROJ_PROJECTORS == SUPPORTED
