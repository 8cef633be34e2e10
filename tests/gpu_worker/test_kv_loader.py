"""KV pool sizing and page-table deltas; strict weight loading (batch validation: test_batch_checks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from gpu_worker.backends.memory import CPU_MAX_KV_TOKENS, available_ram_bytes, kv_pool_tokens
from gpu_worker.kv_cache import KVPool
from gpu_worker.weights.loader import WeightMismatchError, load_model
from tests.gpu_worker.helpers import save_tiny_model


def small_pool(page_size: int = 4) -> KVPool:
    return KVPool(
        num_layers=2,
        kv_heads=2,
        head_dim=8,
        num_pages=10,
        page_size=page_size,
        max_requests=3,
        context_len=30,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def test_page_deltas_land_where_the_scheduler_said() -> None:
    pool = small_pool()
    assert pool.page_table.shape == (3, 8) and pool.k[0].shape == (40, 2, 8)
    pool.apply_page_deltas(req_pool_idx=[2, 0], page_starts=[0, 0], page_counts=[3, 1], pages=[9, 4, 7, 1])
    pool.apply_page_deltas(
        req_pool_idx=[0, 1, 2], page_starts=[1, 0, 3], page_counts=[2, 0, 1], pages=[5, 6, 8]
    )
    assert pool.page_table[2, :4].tolist() == [9, 4, 7, 8]
    assert pool.page_table[0, :3].tolist() == [1, 5, 6]
    assert pool.page_table[1].tolist() == [0] * 8


def test_pool_size_from_config_or_memory() -> None:
    cpu = torch.device("cpu")
    assert kv_pool_tokens(1000, 0.5, 1024, cpu) == 1000
    assert available_ram_bytes() > 0
    assert 0 < kv_pool_tokens(0, 0.2, 1 << 20, cpu) <= CPU_MAX_KV_TOKENS
    assert kv_pool_tokens(0, 0.9, 1, cpu) == CPU_MAX_KV_TOKENS


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", False, path)
    return path


def rewrite_weights(src: Path, dst: Path, drop: str | None = None, add: str | None = None) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    weights = load_file(str(src / "model.safetensors"))
    if drop is not None:
        del weights[drop]
    if add is not None:
        weights[add] = torch.zeros(3)
    save_file(weights, str(dst / "model.safetensors"))
    return dst


def test_missing_or_unexpected_weight_is_an_error(llama_dir: Path, tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    missing = rewrite_weights(llama_dir, tmp_path / "missing", drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(WeightMismatchError, match="up_proj"):
        load_model(missing, torch.float64, cpu)
    no_head = rewrite_weights(llama_dir, tmp_path / "no_head", drop="lm_head.weight")  # untied: required
    with pytest.raises(WeightMismatchError, match="lm_head"):
        load_model(no_head, torch.float64, cpu)
    extra = rewrite_weights(llama_dir, tmp_path / "extra", add="model.layers.0.surprise")
    with pytest.raises(WeightMismatchError, match="surprise"):
        load_model(extra, torch.float64, cpu)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path) -> None:
    hf = save_tiny_model("qwen2", False, tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="60KB")
    (tmp_path / "sharded" / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    one, _ = load_model(tmp_path / "one", torch.float64, torch.device("cpu"))
    sharded, _ = load_model(tmp_path / "sharded", torch.float64, torch.device("cpu"))
    assert isinstance(one, nn.Module) and isinstance(sharded, nn.Module)
    for (name, a), (_, b) in zip(one.state_dict().items(), sharded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
