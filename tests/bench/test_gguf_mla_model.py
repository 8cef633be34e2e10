"""bench/lib/gguf_mla_model.py's DeepSeek-V2-Lite-shaped GGUF: the Q4_K_M mix and size of the full
shape (from the tensor list, no 3 GB file), and a small version of the same layout written and served
by the real loader (kv_b split into attn_k_b / attn_v_b, experts and projections in their blocks)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from bench.lib import gguf_mla_model
from bench.lib.gguf_models import Q
from gpu_worker.backends.cpu.experts import QuantExperts
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.moe import Experts
from gpu_worker.weights.model_files import resolve_model
from tests.exactness import inprocess

SMALL = dataclasses.replace(
    gguf_mla_model.V2_LITE, hidden=256, layers=2, heads=4, vocab=49152, context=512, rank=256, rope=32,
    nope=64, v=64, experts=8, used=2, expert_ffn=256, shared=2, dense_ffn=512,
)  # fmt: skip


def test_full_shape_q4_k_m_mix_and_size() -> None:
    tensors = {
        name: (qtype, dims) for name, qtype, dims in gguf_mla_model.tensors(gguf_mla_model.V2_LITE, "q4_k_m")
    }
    assert tensors["blk.1.attn_kv_a_mqa.weight"] == (Q.Q4_K, (576, 2048))
    assert tensors["blk.1.attn_k_b.weight"] == (Q.Q5_0, (16, 512, 128))  # rows of 128: Q4_K's fallback
    assert tensors["blk.1.attn_v_b.weight"] == (Q.Q4_K, (16, 128, 512))
    assert tensors["blk.1.attn_q.weight"] == (Q.Q4_K, (3072, 2048))
    assert tensors["blk.1.ffn_gate_inp.weight"] == (None, (64, 2048))
    assert tensors["blk.2.ffn_gate_exps.weight"] == (Q.Q4_K, (64, 1408, 2048))
    assert tensors["blk.0.ffn_gate.weight"] == (Q.Q4_K, (10944, 2048))
    nbytes = sum(
        math.prod(dims) * 4
        if qtype is None
        else math.prod(dims) // gguf.GGML_QUANT_SIZES[qtype][0] * gguf.GGML_QUANT_SIZES[qtype][1]
        for qtype, dims in tensors.values()
    )
    assert 10.2e9 < nbytes < 10.5e9, nbytes  # all 27 layers


def test_small_shape_serves_with_blocks(tmp_path: Path) -> None:
    path = gguf_mla_model.write_model(tmp_path / "model.gguf", "q4_k_m", SMALL)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RIVULET_CACHE_DIR", str(tmp_path / "cache"))
        model_dir = resolve_model(str(path))
    runner = ModelRunner(
        WorkerConfig(model_path=str(model_dir), gguf_path=str(path), dtype="float32", weight_dtype="gguf",
                     page_size=16, kv_cache_tokens=256, num_threads=1)
    )  # fmt: skip
    assert runner.hf_config.model_type == "deepseek_v2" and runner.hf_config.qk_nope_head_dim == 64
    model: Any = runner.model
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert len(experts) == 1 and isinstance(experts[0].impl, QuantExperts)
    assert model.model.layers[1].self_attn.q_proj.quantized is not None
    assert runner.kv.k[0].shape[1:] == (1, 256 + 32)
    logits: list[torch.Tensor] = []
    model.register_forward_hook(lambda _m, _a, out: logits.append(out))
    got, _ = inprocess.generate(
        runner, [[5, 6, 7, 8, 9]], 4, chunked_prefill_size=64, enable_mixed_chunk=False
    )
    assert len(got[0]) == 4 and all(0 <= t < 49152 for t in got[0])
    assert all(torch.isfinite(h).all() for h in logits)


def test_worker_step_takes_the_latent_form(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.worker_step's ``/latent=FORM`` variant suffix sets --latent-attention (the decode bench
    of the absorbed form against the expanded one)."""
    import argparse

    from bench.worker_step import make_runner

    path = gguf_mla_model.write_model(tmp_path / "model.gguf", "q4_k_m", SMALL)
    monkeypatch.setenv("RIVULET_CACHE_DIR", str(tmp_path / "cache"))
    args = argparse.Namespace(model=str(path), decode_batches=[1], context=32, prefill=0, prefill_prompts=1,
                              compile=False, num_threads=1)  # fmt: skip
    runner = make_runner(args, "float32:gguf/kv=float32/latent=expanded")
    assert runner.config.latent_attention == "expanded" and runner.kv_dtype == torch.float32
