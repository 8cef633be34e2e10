"""--kv-cache-dtype on the embedded SmolLM2 GGUF (its blocks, float32 activations, the C kernels):
greedy outputs over a 16-bit KV pool against HF float32 by the bf16 test's top-2 rule, served
together with chunked prefill and mixed batches; the pool holds twice the tokens in the same memory.

float16 keeps the first answer token of "What is the capital of France?" (a 0.08 tie in HF float32):
teacher-forced over these prompts float16 K/V move the logits by at most ~0.02 from float32 K/V's,
bfloat16 ones by up to ~0.18, so only float16 has its answer checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.backends import memory
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.weights.model_files import source_gguf
from tests.exactness import inprocess
from tests.exactness.test_smollm2_bf16 import NEW_TOKENS, first_divergence_within_top2
from tests.exactness.test_smollm2_fp32 import EOS, QUESTIONS, chat_prompt


def runner(smollm2_dir: Path, kv: str, **config: Any) -> ModelRunner:
    gguf = source_gguf(None)
    assert gguf is not None
    return ModelRunner(
        WorkerConfig(model_path=str(smollm2_dir), gguf_path=str(gguf), weight_dtype="gguf", dtype="float32",
                     kv_cache_dtype=kv, **{"kv_cache_tokens": 4096, **config})
    )  # fmt: skip


@pytest.fixture(scope="module")
def hf_fp32(smollm2_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("kv", ["auto", "bfloat16", "float16"])
def test_16_bit_kv_keeps_the_greedy_answers_by_the_top2_rule(
    smollm2_dir: Path, hf_fp32: Any, kv: str
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [chat_prompt(tokenizer, q) for q in QUESTIONS]
    r = runner(smollm2_dir, kv)
    assert r.kv_dtype == (torch.bfloat16 if kv == "bfloat16" else torch.float16), "auto: float16 here"
    ours, _ = inprocess.generate(
        r, prompts, NEW_TOKENS, chunked_prefill_size=16, enable_mixed_chunk=True, stop_token_ids=(EOS,)
    )
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = hf_fp32.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        first_divergence_within_top2(hf_fp32, prompt, got, out[0, len(prompt) :].tolist())
    if kv != "bfloat16":
        assert tokenizer.decode(ours[0], skip_special_tokens=True) == "The capital of France is Paris."


def test_a_16_bit_pool_holds_twice_the_tokens(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "available_ram_bytes", lambda: 2**30)  # a fixed 1 GiB to share
    sizes = {kv: runner(smollm2_dir, kv, kv_cache_tokens=0, kv_mem_fraction=0.5).num_pages for kv in
             ("float32", "bfloat16", "float16")}  # fmt: skip
    assert sizes["bfloat16"] == sizes["float16"] == pytest.approx(2 * sizes["float32"], abs=1)
