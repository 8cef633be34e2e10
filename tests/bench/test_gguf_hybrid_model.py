"""bench/lib/gguf_hybrid_model.py's Qwen3.5 shapes, made small, load as the engine loads a GGUF (blocks
kept, the hybrid config from the metadata) and generate."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.lib.gguf_hybrid_model import SHAPES, HybridShape, tensors, write_model
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.weights.model_files import resolve_model
from tests.exactness import inprocess


def small(name: str) -> HybridShape:
    """``name``'s shape at a few percent of its size (its layer pattern and kinds of tensors kept)."""
    shape = SHAPES[name]
    small = dataclasses.replace(shape, hidden=256, layers=4, heads=2, kv_heads=1, head_dim=64, key_heads=2,
                                value_heads=4, linear_dim=64, ffn=512 if shape.ffn else 0)  # fmt: skip
    if shape.experts:
        small = dataclasses.replace(small, experts=4, experts_used=2, expert_ffn=256, shared_ffn=256)
    return small


@pytest.mark.parametrize("name", list(SHAPES))
def test_three_linear_layers_then_a_full_one(name: str) -> None:
    listed = {n for n, _, _ in tensors(small(name), "q4_k_m")}
    assert {"blk.0.ssm_a", "blk.2.ssm_dt.bias", "blk.3.attn_q.weight"} <= listed
    assert "blk.3.ssm_a" not in listed and "blk.0.attn_q.weight" not in listed


def test_small_moe_shape_loads_and_generates(tmp_path: Path) -> None:
    path = write_model(tmp_path / "model.gguf", small("qwen35moe_35b"), "q4_k_m")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RIVULET_CACHE_DIR", str(tmp_path / "cache"))
        meta = resolve_model(str(path))
    runner = ModelRunner(
        WorkerConfig(model_path=str(meta), gguf_path=str(path), dtype="float32", page_size=16,
                     kv_cache_tokens=512, num_threads=1, max_running_requests=4)
    )  # fmt: skip
    assert runner.states is not None and runner.states.shape.layers == 3
    got, _ = inprocess.generate(runner, [[5, 6, 7, 8, 9], [10, 11]], 4, chunked_prefill_size=64,
                                enable_mixed_chunk=True)  # fmt: skip
    assert [len(out) for out in got] == [4, 4]
