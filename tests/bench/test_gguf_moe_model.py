"""bench/gguf_models.py's Qwen3-30B-A3B-shaped mixture of experts: llama.cpp's Q4_K_M mix on the full
shape (from the tensor list, no 3 GB file) and a small version of the same shape
written and served by the real loader with its experts kept in their blocks."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from bench.lib import gguf_models
from bench.lib.gguf_models import QWEN3_MOE_30B, Q
from gpu_worker.backends.cpu.experts import QuantExperts
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.moe import Experts
from gpu_worker.weights.formats import QuantizedExperts
from gpu_worker.weights.model_files import resolve_model
from tests.exactness import inprocess

# The same architecture and types, 2 layers (layer 1 "more bits": down and v in Q6_K), 8 experts of
# 256 (top 2), heads of 128 over a hidden of 256 (key_length != hidden / heads, as the full shape's).
SMALL_MOE = dataclasses.replace(
    QWEN3_MOE_30B, name="smallmoe", hidden=256, layers=2, heads=4, kv_heads=2, ffn=512,
    experts=8, experts_used=2, expert_ffn=256, context=512,
)  # fmt: skip


def test_full_shape_q4_k_m_mix_and_size() -> None:
    """Q4_K experts and attention, Q6_K down experts and v in the more-bits layers (0, 3, 6, 7 of 8),
    an F32 router, Q4_K embedding and Q6_K untied output: about 3.2 GB."""
    tensors = {name: (qtype, dims) for name, qtype, dims in gguf_models._tensors(QWEN3_MOE_30B, "q4_k_m")}
    assert tensors["token_embd.weight"] == (Q.Q4_K, (49152, 2048))
    assert tensors["output.weight"] == (Q.Q6_K, (49152, 2048))
    for i in range(8):
        wide = Q.Q6_K if i in (0, 3, 6, 7) else Q.Q4_K
        assert tensors[f"blk.{i}.ffn_down_exps.weight"] == (wide, (128, 2048, 768)), i
        assert tensors[f"blk.{i}.attn_v.weight"] == (wide, (512, 2048)), i
        assert tensors[f"blk.{i}.ffn_gate_exps.weight"] == (Q.Q4_K, (128, 768, 2048))
        assert tensors[f"blk.{i}.ffn_up_exps.weight"] == (Q.Q4_K, (128, 768, 2048))
        assert tensors[f"blk.{i}.attn_q.weight"] == (Q.Q4_K, (4096, 2048))
        assert tensors[f"blk.{i}.attn_output.weight"] == (Q.Q4_K, (2048, 4096))
        assert tensors[f"blk.{i}.ffn_gate_inp.weight"] == (None, (128, 2048))
        assert tensors[f"blk.{i}.attn_k_norm.weight"] == (None, (128,))
    nbytes = sum(
        math.prod(dims) * 4
        if qtype is None
        else math.prod(dims) // gguf.GGML_QUANT_SIZES[qtype][0] * gguf.GGML_QUANT_SIZES[qtype][1]
        for qtype, dims in tensors.values()
    )
    assert 3.1e9 < nbytes < 3.2e9, nbytes


def test_small_moe_serves_with_experts_in_blocks(tmp_path: Path) -> None:
    """The file's metadata makes a Qwen3-MoE config, every tensor loads, the experts stay in their
    Q4_K/Q6_K blocks (QuantExperts), and greedy decoding gives finite logits and in-vocabulary tokens."""
    gguf_path = gguf_models.write_model(tmp_path / "model.gguf", SMALL_MOE, "q4_k_m")
    reader = gguf.GGUFReader(str(gguf_path))
    assert reader.fields["general.architecture"].contents() == "qwen3moe"
    assert reader.fields["qwen3moe.expert_used_count"].contents() == 2
    router = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate_inp.weight")
    assert np.isfinite(router.data).all() and 0.015 < float(np.std(router.data)) < 0.025
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RIVULET_CACHE_DIR", str(tmp_path / "cache"))
        model_dir = resolve_model(str(gguf_path))
    runner = ModelRunner(
        WorkerConfig(model_path=str(model_dir), gguf_path=str(gguf_path), dtype="float32",
                     weight_dtype="gguf", page_size=16, kv_cache_tokens=256, num_threads=1)
    )  # fmt: skip
    model: Any = runner.model
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert len(experts) == 2 and all(isinstance(m.impl, QuantExperts) for m in experts)
    blocks = [m.quantized for m in experts]
    assert all(isinstance(b, QuantizedExperts) for b in blocks)
    assert [tuple(Q(p.type) for p in b.projections) for b in blocks if b is not None] == [
        (Q.Q4_K, Q.Q4_K, Q.Q4_K),
        (Q.Q4_K, Q.Q4_K, Q.Q6_K),
    ]
    logits: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda _m, _args, out: logits.append(out.detach().clone()))
    prompts = [[1, 200, 3000, 45000], [7, 8, 9, 10, 11, 12, 13]]
    got, _ = inprocess.generate(runner, prompts, 4, chunked_prefill_size=16, enable_mixed_chunk=True)
    assert [len(out) for out in got] == [4, 4]
    assert all(0 <= t < SMALL_MOE.vocab for out in got for t in out)
    # An all-greedy batch draws inside the head's kernel (no logits): the logits route again, for them.
    assert runner.head_argmax and not logits
    runner.head_argmax = False
    again, _ = inprocess.generate(runner, prompts, 4, chunked_prefill_size=16, enable_mixed_chunk=True)
    assert again == got
    assert logits and all(torch.isfinite(x).all() and float(x.std()) > 0 for x in logits)
