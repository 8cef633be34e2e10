"""Greedy outputs of the engine (scheduler core + model runner) equal HF transformers', token for token.

Small random models in float64, a batch of prompts of mixed lengths served
together, over chunk sizes, page sizes and mixed-chunk on/off.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from tests.exactness import inprocess
from tests.models import FAMILIES, VOCAB, save_tiny_model

NEW_TOKENS = 8
PROMPT_LENS = (1, 3, 17, 40, 64, 9)


def exactness_prompts() -> list[list[int]]:
    """Random prompts of PROMPT_LENS tokens (seed 7): one token, a few, past a page, several chunks."""
    rng = random.Random(7)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list, list]:
    """(model dir, prompts, HF greedy outputs) for one family."""
    path = tmp_path_factory.mktemp(request.param)
    model = save_tiny_model(request.param, request.param in ("qwen2", "gpt2"), path)  # float64, EOS off
    prompts = exactness_prompts()
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
            expected.append(out[0, len(prompt) :].tolist())
    return path, prompts, expected


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunked_prefill_size", [5, 256, -1])
@pytest.mark.parametrize("mixed", [False, True], ids=["alternate", "mixed"])
def test_greedy_matches_hf(
    family_model: tuple[Path, list, list], page_size: int, chunked_prefill_size: int, mixed: bool
) -> None:
    path, prompts, expected = family_model
    runner = ModelRunner(
        WorkerConfig(
            model_path=str(path), dtype="float64", page_size=page_size, kv_cache_tokens=2048, num_threads=1
        )
    )
    got, scheduler = inprocess.generate(
        runner, prompts, NEW_TOKENS, chunked_prefill_size=chunked_prefill_size, enable_mixed_chunk=mixed
    )
    assert len({t for out in expected for t in out}) > NEW_TOKENS, "the reference must not be degenerate"
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} ({len(prompts[i])} tokens)"
    assert scheduler.kv.used_tokens == 0, "every page must be free once all requests finished"


def test_small_prefill_budget_spreads_prompts_over_rounds(family_model: tuple[Path, list, list]) -> None:
    path, prompts, expected = family_model
    runner = ModelRunner(
        WorkerConfig(model_path=str(path), dtype="float64", page_size=4, kv_cache_tokens=1024)
    )
    got, _ = inprocess.generate(runner, prompts, NEW_TOKENS, chunked_prefill_size=16, enable_mixed_chunk=True,
                                max_prefill_tokens=20)  # fmt: skip
    assert got == expected


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_backends_agree_in_float64(family_model: tuple[Path, list, list], backend: str) -> None:
    """The torch reference backend and the CPU backend (its torch paths in float64: the C kernels
    take float32 and bf16) give HF's tokens over chunked prefill and mixed batches."""
    path, prompts, expected = family_model
    runner = ModelRunner(
        WorkerConfig(
            model_path=str(path),
            dtype="float64",
            device_backend=backend,
            page_size=16,
            kv_cache_tokens=2048,
            num_threads=1,
        )
    )
    assert runner.backend.name == backend
    got, _ = inprocess.generate(runner, prompts, NEW_TOKENS, chunked_prefill_size=5, enable_mixed_chunk=True)
    assert got == expected
