"""The engine core with the Triton backend (interpreted on CPU): greedy float32 outputs equal HF's.

Tiny random Llama, Qwen3 and GPT-2 models; prompts that share prefixes (cache hits), chunked
prefill, mixed batches, and a KV pool small enough that requests are retracted. Compared with HF
float32 token for token; where HF's own top two logits at a step are within TIE of each other,
float32 rounding may pick either, so a sequence is checked up to the first such near tie only (the
top-2 rule of the bf16 tests).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from tests.exactness import inprocess
from tests.models import VOCAB, save_tiny_model

pytest.importorskip("triton")  # a dependency on Linux x86-64 only
pytestmark = pytest.mark.triton_interpreter

NEW_TOKENS = 10
TIE = 1e-3  # float32 logits closer than this may order either way between two exact implementations


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    system = [rng.randrange(3, VOCAB) for _ in range(37)]
    shared = [system + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(4)]
    other = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 5, 23)]
    return shared + other + [shared[0]]


def checked_prefix(model: Any, prompt: list[int], got: list[int]) -> int:
    """How many of ``got``'s tokens HF float32 confirms: all, or up to the first step whose top
    two logits are a near tie (either may be drawn); a real mismatch fails."""
    ids = list(prompt)
    for step, token in enumerate(got):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        top2 = torch.topk(logits, 2)
        if token != int(top2.indices[0]):
            gap = float(logits[top2.indices[0]] - logits[token])
            assert gap < TIE, f"step {step}: drew {token}, HF's greedy is {int(top2.indices[0])} ({gap:.2e})"
            return step
        if float(top2.values[0] - top2.values[1]) < TIE:
            return step + 1
        ids.append(token)
    return len(got)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_triton_backend_greedy_matches_hf_float32(family: str, tmp_path: Path) -> None:
    model = save_tiny_model(family, family == "gpt2", tmp_path).to(torch.float32)
    runner = ModelRunner(
        WorkerConfig(
            model_path=str(tmp_path),
            dtype="float32",
            attention_backend="triton",
            page_size=4,
            kv_cache_tokens=1024,
            num_threads=1,
        )
    )
    assert runner.backend.name == "triton"
    batch_prompts = prompts()
    tiny = {"num_pages": 120 // 4, "schedule_conservativeness": 0.2}  # 120 tokens of KV: retraction
    got, sched = inprocess.generate(
        runner,
        batch_prompts,
        NEW_TOKENS,
        chunked_prefill_size=16,
        enable_mixed_chunk=True,
        scheduler_overrides=tiny,
    )
    assert sched.num_cached_prompt_tokens > 0, "no prefix-cache hit"
    assert sched.num_retracted > 0, "the tiny pool must force a retraction"
    assert sched.kv.available_pages == sched.config.num_pages, "pages leaked"
    checked = [checked_prefix(model, p, g) for p, g in zip(batch_prompts, got, strict=True)]
    assert all(len(g) == NEW_TOKENS for g in got)
    assert sum(checked) >= len(got) * NEW_TOKENS * 3 // 4, f"too few tokens confirmed: {checked}"
