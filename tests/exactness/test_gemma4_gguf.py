"""Gemma 4 from a ``gemma4`` GGUF written as llama.cpp's converter writes one (tests/gemma4_gguf.py):
its config read from the metadata (per-layer arrays, k = v from a missing attn_v, the global layers'
partial rotation from rope_freqs), its tensors by the converter's names, token-exact against HF
float64 holding the file's weights; and with Q8_0 blocks (the stacked experts' too) kept as blocks on
the CPU kernels."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import pytest

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.weights.model_files import resolve_model
from tests.exactness import inprocess
from tests.exactness.test_gemma4 import NEW_TOKENS, hf_greedy, prompts
from tests.gemma4_gguf import write_gemma4_gguf
from tests.gemma4_models import save_gemma4

Q8 = gguf.GGMLQuantizationType.Q8_0
BLOCKS = {
    kind: Q8
    for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "inp_gate",
                 "ffn_gate_up_exps", "ffn_down_exps")
}  # fmt: skip


def gguf_runner(path: Path, gguf_file: Path, **extra: Any) -> ModelRunner:
    with pytest.MonkeyPatch.context() as patch:  # the metadata directory under the test's own cache
        patch.setenv("RIVULET_CACHE_DIR", str(path / "cache"))
        meta = resolve_model(str(gguf_file))
    config: dict[str, Any] = dict(model_path=str(meta), gguf_path=str(gguf_file), dtype="float64",
                                  page_size=4, kv_cache_tokens=1024, num_threads=1)  # fmt: skip
    config.update(extra)
    return ModelRunner(WorkerConfig(**config))


@pytest.mark.parametrize("blocks", [False, True], ids=["f32", "q8_0-blocks"])
def test_gguf_matches_hf(tmp_path: Path, blocks: bool) -> None:
    """The multimodal checkpoint's text model as the converter writes it (towers left out), F32 in
    float64; or with Q8_0 projections held as blocks, float32 activations and pool."""
    hf = save_gemma4(tmp_path, multimodal=True)
    held = write_gemma4_gguf(tmp_path / "model.gguf", hf, BLOCKS if blocks else None)
    hf.load_state_dict(held, strict=False)  # the file's weights (F32, or Q8_0's values)
    text = hf.model.language_model  # a text GGUF has no media placeholders: the text model's tokens
    reference = save_gemma4(tmp_path / "text")
    reference.model.load_state_dict(text.state_dict())
    few = prompts()[1:4]
    expected = hf_greedy(reference, few)
    extra = dict(dtype="float32", kv_cache_dtype="float32", weight_dtype="gguf") if blocks else {}
    run = gguf_runner(tmp_path, tmp_path / "model.gguf", **extra)
    config = json.loads((Path(run.config.model_path) / "config.json").read_text())
    assert config["attention_k_eq_v"] and config["use_double_wide_mlp"] and config["enable_moe_block"]
    assert config["rope_parameters"]["full_attention"]["partial_rotary_factor"] == 0.25
    assert [tuple(k.shape[1:]) for k in run.kv.k] == [(2, 16), (1, 32), (2, 16), (1, 32)]
    if blocks:
        attention: Any = run.model.decoder_layers()[0].self_attn
        assert attention.qkv_proj.quantized is not None, "the Q8_0 projections stay in their blocks"
        experts: Any = run.model.decoder_layers()[0].experts
        assert experts.quantized is not None, "so do the stacked experts (the file's gate_up split)"
    got, _ = inprocess.generate(run, few, NEW_TOKENS, chunked_prefill_size=5, enable_mixed_chunk=True)
    assert got == expected
