"""llama.cpp's mmproj GGUF (--mmproj): Gemma 3's vision tower read from it equals HF's given the
weights the file holds (the projection rounded to float16, the rest to float32), and the runner
takes its tower from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.weights.mmproj import load_mmproj_tower, mmproj_config, our_name
from tests.models import save_tiny_model
from tests.vision_models import write_gemma3_mmproj


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Path]:
    out = tmp_path_factory.mktemp("gemma3")
    model = save_tiny_model("gemma3", True, out)
    mmproj = out / "mmproj.gguf"
    write_gemma3_mmproj(model, mmproj)
    return out, model, mmproj


def rounded_as_the_file(model: Any) -> None:
    """HF's tower and projector holding what the mmproj file holds."""
    with torch.no_grad():
        for param in model.model.vision_tower.parameters():
            param.copy_(param.float().double())
        projector = model.model.multi_modal_projector
        projector.mm_input_projection_weight.copy_(projector.mm_input_projection_weight.half().double())
        norm = projector.mm_soft_emb_norm.weight
        norm.copy_((norm.float() + 1.0).double() - 1.0)


def test_the_tower_from_an_mmproj_is_hfs(tiny: tuple[Path, Any, Path]) -> None:
    _, model, mmproj = tiny
    tower = load_mmproj_tower(mmproj, torch.float64, torch.device("cpu"))
    rounded_as_the_file(model)
    pixels = torch.randn(3, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.model.get_image_features(pixels).pooler_output
        got = tower(pixels)
    assert got.shape == want.shape == (3, 4, model.config.text_config.hidden_size)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_names_and_config() -> None:
    assert our_name("v.blk.3.attn_out.bias") == "vision_tower.encoder.layers.3.self_attn.out_proj.bias"
    assert our_name("v.blk.0.ffn_up.weight") == "vision_tower.encoder.layers.0.mlp.fc1.weight"
    assert our_name("v.blk.0.unknown.weight") is None
    fields = {
        "clip.projector_type": "gemma3",
        "clip.vision.embedding_length": 1152,
        "clip.vision.feed_forward_length": 4304,
        "clip.vision.block_count": 27,
        "clip.vision.attention.head_count": 16,
        "clip.vision.image_size": 896,
        "clip.vision.patch_size": 14,
        "clip.vision.attention.layer_norm_epsilon": 1e-6,
    }
    assert mmproj_config(fields, 2560).mm_tokens_per_image == 256, (
        "Gemma 3's default: 64x64 patches pooled 4x4"
    )
    with pytest.raises(ValueError, match="not supported"):
        mmproj_config({**fields, "clip.projector_type": "qwen2vl_merger"}, 2560)


def test_the_runner_takes_its_tower_from_mmproj(tiny: tuple[Path, Any, Path]) -> None:
    from gpu_worker.config import WorkerConfig
    from gpu_worker.model_runner import ModelRunner

    path, _, mmproj = tiny
    config = WorkerConfig(model_path=str(path), dtype="float64", kv_cache_tokens=256, num_threads=1)
    runner = ModelRunner(WorkerConfig(**{**config.__dict__, "mmproj": str(mmproj)}))
    assert runner.images is not None
    file_tower = load_mmproj_tower(mmproj, torch.float64, torch.device("cpu"))
    pixels = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(runner.images.tower(pixels), file_tower(pixels))
