"""The gpt-oss-20b-shaped bench GGUF (bench/lib/gguf_gpt_oss_model.py), written smaller: loads through
the real GGUF loader with its experts kept in MXFP4 blocks and its other matrices in BF16, layers
alternating sliding and full, and decodes finite logits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from bench.lib import gguf_gpt_oss_model as bench_model
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.weights.gguf_file import read_header
from gpu_worker.weights.model_files import resolve_model
from tests.gpu_worker.helpers import GREEDY, MiniScheduler

SMALL = dataclasses.replace(bench_model.GPT_OSS_20B, hidden=128, layers=3, heads=4, kv_heads=2,
                            head_dim=32, vocab=49152, context=4096, experts=4, used=2, expert_ffn=64,
                            window=8)  # fmt: skip


def test_small_bench_gpt_oss_loads_and_decodes(tmp_path: Path) -> None:
    path = bench_model.write_model(tmp_path / "model.gguf", SMALL)
    header = read_header(path)
    assert header.architecture == "gpt-oss"
    assert header.tensor("blk.0.ffn_down_exps.weight").type == 39  # type: ignore[union-attr]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RIVULET_CACHE_DIR", str(tmp_path / "cache"))
        meta = resolve_model(str(path))
    config = WorkerConfig(model_path=str(meta), gguf_path=str(path), dtype="float32", page_size=16,
                          kv_cache_tokens=512, num_threads=1)  # fmt: skip
    runner = ModelRunner(config)
    layers = runner.model.model.layers  # type: ignore[attr-defined]
    assert [layer.attention.sliding_window for layer in layers] == [8, 0, 8]
    assert layers[0].mlp.experts.quantized is not None, "experts kept in their MXFP4 blocks"
    prompt = list(range(100, 120))
    logits = runner.compute_logits(MiniScheduler(runner.num_pages, 16).batch([(0, 0, prompt, True, GREEDY)]))
    assert logits.shape[-1] == 49152 and torch.isfinite(logits).all()
