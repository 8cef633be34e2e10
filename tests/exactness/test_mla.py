"""Latent attention (DeepSeek-V2/V3, GLM-4.7-Flash) in the engine's core equals HF transformers' float64.

Tiny random models (tests/mla_models.py: V2-Lite without q_lora_rank, V2 with group-limited routing,
V3 with a random score-correction bias, group top-k and YaRN's mscale, GLM with K and V heads of
different sizes and dense layers by ``mlp_layer_types``), loaded from their HF directories, served
through the scheduler core and the model runner over chunked prefill and mixed batches: greedy tokens
equal HF's in each attention form, and each token's logprob equals HF's within float64 rounding in
both forms (the absorbed one adds in another order). The pool holds one latent row a token a layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from protocol import WorkerSampling
from tests.exactness import inprocess
from tests.mla_models import KINDS, hf_greedy, make_prompts, save_mla_model

NEW_TOKENS = 8
PROMPT_LENS = (1, 3, 17, 40, 9)
LOGPROB_TOLERANCE = 1e-5
FORMS_TOLERANCE = 1e-10


@pytest.fixture(scope="module", params=KINDS)
def mla_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp(request.param)
    return path, save_mla_model(request.param, path)


def runner_for(path: Path, form: str = "auto", **extra: Any) -> ModelRunner:
    config: dict[str, Any] = dict(model_path=str(path), dtype="float64", page_size=4, kv_cache_tokens=1024,
                                  num_threads=1, latent_attention=form)  # fmt: skip
    config.update(extra)
    return ModelRunner(WorkerConfig(**config))


@pytest.mark.parametrize("form", ["auto", "absorbed", "expanded"])
def test_greedy_matches_hf(mla_model: tuple[Path, Any], form: str) -> None:
    path, hf = mla_model
    prompts = make_prompts(3, PROMPT_LENS)
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    runner = runner_for(path, form)
    got, scheduler = inprocess.generate(runner, prompts, NEW_TOKENS, chunked_prefill_size=5,
                                        enable_mixed_chunk=True)  # fmt: skip
    assert len({t for out in expected for t in out}) > NEW_TOKENS, "the reference must not be degenerate"
    assert got == expected
    assert scheduler.kv.used_tokens == 0


def test_pool_holds_one_latent_row_a_token(mla_model: tuple[Path, Any]) -> None:
    """K and V are one tensor a layer of kv_lora_rank + qk_rope_head_dim values a token."""
    path, hf = mla_model
    runner = runner_for(path)
    cfg = hf.config
    assert runner.kv.v is runner.kv.k and len(runner.kv.k) == cfg.num_hidden_layers
    assert runner.kv.k[0].shape[1:] == (1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def _hf_token_logprobs(hf: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    chosen = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])
    return chosen.flatten().tolist()


def test_logprobs_within_rounding_of_hf(mla_model: tuple[Path, Any]) -> None:
    """Every generated token's logprob, prompts prefilled in chunks of 7 beside decode rows, equals
    HF's within the rounding of HF's float32 router (its sums differ by the rows in a matmul)."""
    path, hf = mla_model
    prompts = make_prompts(8, (12, 2, 30))
    sampler = WorkerSampling(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0, logprobs=True)
    logprobs: list[list[float]] = []
    got, _ = inprocess.generate(runner_for(path), prompts, 6, chunked_prefill_size=7,
                                enable_mixed_chunk=True, sampler=sampler, logprobs=logprobs)  # fmt: skip
    for prompt, tokens, lps in zip(prompts, got, logprobs, strict=True):
        want = _hf_token_logprobs(hf, prompt, tokens)
        assert max(abs(a - b) for a, b in zip(lps, want, strict=True)) < LOGPROB_TOLERANCE


def test_forms_agree_within_float64_rounding(mla_model: tuple[Path, Any]) -> None:
    """The same batches (prompt chunks of 7 beside decode rows) in the absorbed and the expanded form:
    every step's hidden states agree within float64 rounding, and differ (the sums' order does)."""
    path, _ = mla_model
    prompts = make_prompts(8, (12, 2, 30))
    hidden: dict[str, list[torch.Tensor]] = {}
    for form in ("absorbed", "expanded"):
        runner = runner_for(path, form)
        steps: list[torch.Tensor] = []
        model: Any = runner.model
        model.register_forward_hook(lambda _m, _args, out, steps=steps: steps.append(out.clone()))
        inprocess.generate(runner, prompts, 6, chunked_prefill_size=7, enable_mixed_chunk=True)
        hidden[form] = steps
    assert len(hidden["absorbed"]) == len(hidden["expanded"]) > 6
    diffs = [(a - b).abs().max().item() for a, b in zip(hidden["absorbed"], hidden["expanded"], strict=True)]
    assert max(diffs) < FORMS_TOLERANCE and max(diffs) > 0
