"""SmolLM2-135M-Instruct in float32: our model code against HF's, on real chat prompts.

float32 sums in another order can flip a near-tie, so the rule is: equal tokens,
or at the first step where they differ, both tokens are in HF's top 2 there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from tests.exactness import inprocess

QUESTIONS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "List three prime numbers.",
    "Explain what a KV cache is in one sentence.",
)
NEW_TOKENS = 24
EOS = 2


def chat_prompt(tokenizer: Any, question: str) -> list[int]:
    chat = [{"role": "user", "content": question}]
    return list(
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
    )


def test_smollm2_matches_hf_within_top2(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [chat_prompt(tokenizer, q) for q in QUESTIONS]
    runner = ModelRunner(
        WorkerConfig(model_path=str(smollm2_dir), dtype="float32", kv_cache_tokens=4096, num_threads=1)
    )
    ours, _ = inprocess.generate(
        runner, prompts, NEW_TOKENS, chunked_prefill_size=16, enable_mixed_chunk=True, stop_token_ids=(EOS,)
    )
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for prompt, got in zip(prompts, ours, strict=True):
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[
                0, len(prompt) :
            ]
            ref_tokens = ref.tolist()
            if got == ref_tokens:
                continue
            k = next(i for i, (a, b) in enumerate(zip(got, ref_tokens, strict=False)) if a != b)
            logits = hf(torch.tensor([prompt + got[:k]])).logits[0, -1]
            top2 = set(torch.topk(logits, 2).indices.tolist())
            assert {got[k], ref_tokens[k]} <= top2, (
                f"step {k}: ours {got[k]}, HF {ref_tokens[k]}, HF top-2 {top2}"
            )
    france = tokenizer.decode(ours[0], skip_special_tokens=True)
    assert france == "The capital of France is Paris."
    assert ours[0][-1] == EOS
