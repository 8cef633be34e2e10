"""A float8 e4m3 latent pool (--kv-cache-dtype fp8_e4m3) on a tiny DeepSeek-V2-Lite loaded from its HF
directory, served on the CPU backend's C kernels over chunked prefill, mixed batches, a prefix-cache
hit and n > 1: one byte a value in the pool and its start log, and each token's logprob equal to HF
float64's over the same float8-rounded latent cache within float32 rounding.

float8 legitimately changes this model's greedy tokens from a float32 pool's (3 mantissa bits in
every layer's latents), so the reference is HF with its cache rounded as the pool stores it; a pool
misread, or rounded elsewhere than where it is stored, moves the logprobs by orders more."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.weight_memory import KV_POOL, budget_line
from gpu_worker.config import WorkerConfig
from gpu_worker.kv_cache import as_stored
from gpu_worker.model_runner import ModelRunner
from protocol import WorkerSampling
from tests.exactness import inprocess
from tests.exactness.test_mla import _hf_token_logprobs
from tests.mla_models import make_prompts, save_mla_model

NEW_TOKENS = 6
SHARED = make_prompts(4, (20,))[0]  # a prefix two prompts share (a prefix-cache hit for the second)
PROMPTS = [SHARED + [7, 8, 9], *make_prompts(5, (3, 17)), SHARED + [11]]
# float32 sums against float64's (8e-6 measured); float8's rounding itself moves these logprobs by ~2
LOGPROB_TOLERANCE = 2e-4
FP8 = torch.float8_e4m3fn
SAMPLER = WorkerSampling(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0, logprobs=True)


@pytest.fixture(scope="module")
def v2_lite(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("mla-fp8")
    return path, save_mla_model("v2_lite", path)


def _run(path: Path, kv: str, form: str = "auto") -> tuple[list[list[int]], list[list[float]], ModelRunner]:
    runner = ModelRunner(WorkerConfig(model_path=str(path), dtype="float32", page_size=4, kv_cache_tokens=512,
                                      num_threads=1, kv_cache_dtype=kv, latent_attention=form))  # fmt: skip
    logprobs: list[list[float]] = []
    got, scheduler = inprocess.generate(runner, PROMPTS, NEW_TOKENS, chunked_prefill_size=8, n=2,
                                        enable_mixed_chunk=True, sampler=SAMPLER,
                                        logprobs=logprobs)  # fmt: skip
    assert scheduler.num_cached_prompt_tokens >= 16  # the shared prefix's full pages, read from the pool
    return got, logprobs, runner


@pytest.fixture
def hf_float8_cache(v2_lite: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The HF model with its latent cache rounded as a float8 pool holds it: kv_a_layernorm's output
    and the rotated rope key (HF's V2 attention), every token's, as the engine's pool rows are."""
    import transformers.models.deepseek_v2.modeling_deepseek_v2 as hf_v2

    hf = v2_lite[1]
    rotary = hf_v2.apply_rotary_emb

    def rounded_rotary(xq: torch.Tensor, xk: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k = rotary(xq, xk, freqs)
        return q, as_stored(k, FP8)

    monkeypatch.setattr(hf_v2, "apply_rotary_emb", rounded_rotary)
    hooks = [
        layer.self_attn.kv_a_layernorm.register_forward_hook(lambda _m, _args, out: as_stored(out, FP8))
        for layer in hf.model.layers
    ]
    yield hf
    for hook in hooks:
        hook.remove()


@pytest.mark.cpu_kinds
@pytest.mark.parametrize("form", ["auto", "absorbed"])
def test_float8_pool_against_hf_float64(v2_lite: tuple[Path, Any], hf_float8_cache: Any, form: str) -> None:
    """Each token's logprob within LOGPROB_TOLERANCE of HF float64's over the same float8-rounded latent
    cache (the decode rows on csrc/mla.c; the prompt rows expanded from the pool by torch under auto,
    by the kernel and torch's absorbed form under absorbed); the forks (n = 2) decode the same tokens
    from copied pages."""
    path, _ = v2_lite
    got, logprobs, _ = _run(path, "fp8_e4m3", form)
    diffs = []
    for i, prompt in enumerate(PROMPTS):
        assert got[2 * i] == got[2 * i + 1]  # greedy: a fork decodes what its row does
        want = _hf_token_logprobs(hf_float8_cache, prompt, got[2 * i])
        diffs += [abs(a - b) for a, b in zip(logprobs[2 * i], want, strict=True)]
    assert max(diffs) < LOGPROB_TOLERANCE


def test_pool_bytes_and_start_log(v2_lite: tuple[Path, Any], caplog: pytest.LogCaptureFixture) -> None:
    """One byte a value: a token of the 3-layer model's pool is 3 x (32 + 8) bytes, a quarter of float32's."""
    with caplog.at_level(logging.INFO, logger="gpu_worker.model_runner"):
        _, _, runner = _run(v2_lite[0], "fp8_e4m3")
    assert runner.kv_dtype == torch.float8_e4m3fn and runner.kv.k[0].shape[1:] == (1, 40)
    assert "float8_e4m3fn (120 bytes a token, latent)" in caplog.text
    pool = KV_POOL.findall(caplog.text)[-1]  # as bench.weight_memory reads the start log
    assert budget_line(pool, 1.0) == (
        "KV budget: 512 tokens x 120 bytes a token (float8_e4m3fn) = 61440 bytes (0.000 GiB) fits in 1 GiB"
    )
