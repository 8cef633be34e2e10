"""bench/lib/gguf_gemma4.py's Gemma-4-E4B-shaped GGUF: the Q4_K_M mix and size of the full shape (from
the tensor list, no 1.7 GB file), and a small version of the same layout written and served by the real
loader (per-layer inputs, KV-shared layers, 512-wide global heads, every projection in its blocks)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from bench.lib import gguf_gemma4
from bench.lib.gguf_models import Q
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.weights.model_files import resolve_model
from tests.exactness import inprocess

SMALL = dataclasses.replace(gguf_gemma4.GEMMA4_E4B, hidden=256, ffn=512, vocab=49152, context=512, heads=4,
                            per_layer_dim=256, global_head_dim=512, key_length=256)  # fmt: skip


def test_full_shape_q4_k_m_mix_and_size() -> None:
    tensors = {name: (q, dims) for name, q, dims in gguf_gemma4._tensors(gguf_gemma4.GEMMA4_E4B, "q4_k_m")}
    assert tensors["blk.5.attn_q.weight"] == (Q.Q4_K, (8 * 512, 2560))  # a global layer
    assert tensors["blk.5.attn_v.weight"] == (Q.Q4_K, (2 * 512, 2560))
    assert tensors["blk.0.attn_v.weight"] == (Q.Q6_K, (2 * 256, 2560))  # a "more bits" layer
    assert "blk.6.attn_k.weight" not in tensors and "blk.5.attn_k.weight" in tensors  # 6 of 12 share KV
    assert tensors["per_layer_token_embd.weight"] == (Q.Q4_K, (262144, 12 * 256))
    assert tensors["token_embd.weight"] == (Q.Q6_K, (262144, 2560))
    nbytes = sum(
        math.prod(dims) * 4
        if qtype is None
        else math.prod(dims) // gguf.GGML_QUANT_SIZES[qtype][0] * gguf.GGML_QUANT_SIZES[qtype][1]
        for qtype, dims in tensors.values()
    )
    assert 1.5e9 < nbytes < 1.9e9, nbytes


def test_small_shape_serves_with_blocks(tmp_path: Path) -> None:
    path = gguf_gemma4.write_gemma4(tmp_path / "model.gguf", SMALL, "q4_k_m")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RIVULET_CACHE_DIR", str(tmp_path / "cache"))
        model_dir = resolve_model(str(path))
    runner = ModelRunner(
        WorkerConfig(model_path=str(model_dir), gguf_path=str(path), dtype="float32", weight_dtype="gguf",
                     page_size=16, kv_cache_tokens=256, num_threads=1)
    )  # fmt: skip
    config = runner.hf_config
    assert config.model_type == "gemma4_text" and config.num_kv_shared_layers == 6
    assert config.rope_parameters["full_attention"]["partial_rotary_factor"] == 0.25
    assert len(runner.kv.k) == 6 and runner.kv.k[5].shape[1:] == (2, 512)
    model: Any = runner.model
    assert model.model.layers[5].self_attn.qkv_proj.quantized is not None
    assert model.model.embed_tokens_per_layer.quantized is not None
    logits: list[torch.Tensor] = []
    model.register_forward_hook(lambda _m, _a, out: logits.append(out))
    got, _ = inprocess.generate(
        runner, [[5, 6, 7, 8, 9]], 4, chunked_prefill_size=64, enable_mixed_chunk=False
    )
    assert len(got[0]) == 4 and all(0 <= t < 49152 for t in got[0])
    assert all(torch.isfinite(h).all() for h in logits)
