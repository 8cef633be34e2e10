"""Latent-attention models from ``deepseek2`` GGUFs (tests/mla_gguf.py, written as llama.cpp's
converter writes them) equal HF transformers' float64 greedy tokens: kv_b whole (older files) and split
into attn_k_b / attn_v_b (newer ones), with Q8_0 blocks (dequantized in float64; kept in their blocks
and computed by the CPU kernels in float32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.weights.model_files import resolve_model
from tests.exactness import inprocess
from tests.mla_gguf import write_mla_gguf
from tests.mla_models import hf_greedy, hf_mla_model, make_prompts

NEW_TOKENS = 8
Q8_KINDS = ("attn_q_a", "attn_kv_a_mqa", "attn_output", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
Q8 = {kind: gguf.GGMLQuantizationType.Q8_0 for kind in Q8_KINDS}


def gguf_runner(path: Path, **extra: Any) -> ModelRunner:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RIVULET_CACHE_DIR", str(path / "cache"))
        model_dir = resolve_model(str(path / "model.gguf"))
    config: dict[str, Any] = dict(model_path=str(model_dir), gguf_path=str(path / "model.gguf"),
                                  dtype="float64", page_size=4, kv_cache_tokens=1024,
                                  num_threads=1)  # fmt: skip
    config.update(extra)
    return ModelRunner(WorkerConfig(**config))


@pytest.mark.parametrize(("kind", "split"), [("v2_lite", False), ("v3", True), ("glm", True)])
def test_gguf_greedy_matches_hf(kind: str, split: bool, tmp_path: Path) -> None:
    """GLM's file carries a multi-token-prediction layer too, as its converter keeps it (not served)."""
    hf = hf_mla_model(kind, seed=2)
    hf.load_state_dict(
        write_mla_gguf(tmp_path / "model.gguf", hf, split, Q8, mtp=kind == "glm"), strict=False
    )
    runner = gguf_runner(tmp_path)
    assert runner.hf_config.model_type == ("deepseek_v2" if kind == "v2_lite" else "deepseek_v3")
    assert runner.model.num_layers == hf.config.num_hidden_layers
    prompts = make_prompts(5, (1, 3, 17, 40, 9))
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    got, _ = inprocess.generate(runner, prompts, NEW_TOKENS, chunked_prefill_size=5, enable_mixed_chunk=True)
    assert got == expected


@pytest.mark.cpu_kinds
def test_blocks_kept_in_float32(tmp_path: Path) -> None:
    """Q8_0 projections and experts stay in their blocks (the CPU kernels; the absorbed decode on the
    C attention kernel over the latent pool) and give HF's greedy tokens on the file's weights."""
    from gpu_worker.backends.cpu.experts import QuantExperts
    from gpu_worker.models.moe import Experts

    hf = hf_mla_model("v3", seed=3)
    hf.load_state_dict(write_mla_gguf(tmp_path / "model.gguf", hf, True, Q8), strict=False)
    runner = gguf_runner(tmp_path, dtype="float32", weight_dtype="gguf", page_size=16)
    model: Any = runner.model
    assert all(isinstance(m.impl, QuantExperts) for m in model.modules() if isinstance(m, Experts))
    assert model.model.layers[1].self_attn.q_a_proj.quantized is not None
    prompts = make_prompts(6, (1, 3, 17, 40, 9))
    got, _ = inprocess.generate(runner, prompts, NEW_TOKENS, chunked_prefill_size=16, enable_mixed_chunk=True)
    assert got == hf_greedy(hf, prompts, NEW_TOKENS)
