"""The embedded SmolLM2-135M-Instruct answers a chat prompt through our loader and runner.

Note: takes a few seconds (135M parameters, float32 on the CPU).
"""

from __future__ import annotations

from typing import Any

import pytest

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.weights.model_files import ModelNotFoundError, resolve_model
from tests.gpu_worker.helpers import GREEDY, MiniScheduler

EXPECTED = "The capital of France is Paris."
IM_END = 2


def test_smollm2_greedy_answers_paris() -> None:
    try:
        path = resolve_model(None)
    except ModelNotFoundError as exc:
        pytest.skip(f"embedded model unavailable: {exc}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    encoded: Any = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    prompt: list[int] = list(encoded["input_ids"])
    runner = ModelRunner(
        WorkerConfig(model_path=str(path), dtype="float32", kv_cache_tokens=256, page_size=16, num_threads=1)
    )
    assert (runner.context_len, runner.model.context_len) == (256, 8192), "the pool bounds the context served"
    sched = MiniScheduler(runner.num_pages, 16)
    expected_len = len(tokenizer.encode(EXPECTED)) + 1
    out = runner.execute(sched.batch([(0, 0, prompt, True, GREEDY)])).token_ids
    while out[-1] != IM_END and len(out) < expected_len + 4:
        out += runner.execute(sched.batch([(0, len(prompt) + len(out) - 1, [out[-1]], True, None)])).token_ids
    assert tokenizer.decode(out[:-1]) == EXPECTED
    assert out[-1] == IM_END
