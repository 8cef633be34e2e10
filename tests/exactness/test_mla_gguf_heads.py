"""A ``deepseek2`` GGUF whose attn_k_b / attn_v_b are blocks: the CPU backend's absorbed decode reads
them in place (backends/cpu/latent_heads.py) and the model gives HF's float64 greedy tokens on the
file's weights (DeepSeek-V2-Lite's form: no q_lora_rank, shared experts; heads of 32 so the key
half's rows are whole Q8_0 blocks); its softmax router in C (csrc/moe.c's moe_route)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest

from gpu_worker.backends.cpu.experts import QuantRouter
from gpu_worker.backends.cpu.latent_heads import LatentHeads
from gpu_worker.models.deepseek_moe import DeepseekMoe
from gpu_worker.models.mla import LatentProjection
from tests.exactness import inprocess
from tests.exactness.test_mla_gguf import NEW_TOKENS, Q8, gguf_runner
from tests.mla_gguf import write_mla_gguf
from tests.mla_models import hf_greedy, hf_mla_model, make_prompts

HEADS_Q8 = {**Q8, "attn_k_b": gguf.GGMLQuantizationType.Q8_0, "attn_v_b": gguf.GGMLQuantizationType.Q8_0}


@pytest.mark.cpu_kinds
@pytest.mark.parametrize("form", ["auto", "absorbed"])
def test_kv_b_blocks_in_the_absorbed_decode(form: str, tmp_path: Path) -> None:
    hf = hf_mla_model("v2_lite", seed=4, qk_nope_head_dim=32, v_head_dim=32, kv_lora_rank=64)
    hf.load_state_dict(write_mla_gguf(tmp_path / "model.gguf", hf, True, HEADS_Q8), strict=False)
    runner = gguf_runner(tmp_path, dtype="float32", weight_dtype="gguf", page_size=16, latent_attention=form)
    model: Any = runner.model
    projections = [m for m in model.modules() if isinstance(m, LatentProjection)]
    assert projections and all(isinstance(m.heads, LatentHeads) for m in projections)
    routers = [m.gate for m in model.modules() if isinstance(m, DeepseekMoe)]
    assert routers and all(isinstance(r.route, QuantRouter) for r in routers)  # V2's softmax top-k in C
    prompts = make_prompts(7, (1, 3, 17, 40, 9))
    got, _ = inprocess.generate(runner, prompts, NEW_TOKENS, chunked_prefill_size=16, enable_mixed_chunk=True)
    assert got == hf_greedy(hf, prompts, NEW_TOKENS)
