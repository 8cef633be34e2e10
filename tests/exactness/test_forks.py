"""n > 1 served by the engine (scheduler core + model runner): choice i of an n-request draws
exactly the tokens a single request with seed + i draws, while its prompt is computed once.

A tiny random Llama in float64, sampled (temperature 1: every choice differs), with and without
penalties (a fork starts from its leader's prompt counts), over page sizes that leave the prompt's
last page partly filled (copied for each fork) or not, chunked prefill, no prefix cache (every
prompt page copied) and the overlap scheduler.
"""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from protocol.messages import ForwardBatch
from protocol.sampling import WorkerPenalties, WorkerSampling
from tests.exactness import inprocess
from tests.models import VOCAB, save_tiny_model

N = 4
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama-forks")
    save_tiny_model("llama", False, path)
    return path


def sampler(seed: int, penalties: WorkerPenalties | None) -> WorkerSampling:
    return WorkerSampling(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed=seed, penalties=penalties)


@pytest.mark.parametrize(
    ("page_size", "chunk", "cache", "overlap", "penalized"),
    [
        (4, 64, True, False, False),
        (4, 8, True, True, True),
        (1, 16, True, False, True),
        (16, 64, False, True, False),
    ],
    ids=["partial-page", "chunked-overlap-penalties", "full-pages-penalties", "no-cache-overlap"],
)
def test_choice_i_equals_a_single_request_with_seed_plus_i(
    model_dir: Path, page_size: int, chunk: int, cache: bool, overlap: bool, penalized: bool
) -> None:
    runner = ModelRunner(
        WorkerConfig(model_path=str(model_dir), dtype="float64", page_size=page_size, kv_cache_tokens=2048,
                     num_threads=1)
    )  # fmt: skip
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (27, 42)]
    penalties = [
        WorkerPenalties(prompt_len=len(p), repetition=1.6, presence=0.8) if penalized else None
        for p in prompts
    ]
    base = [sampler(100 * i, pen) for i, pen in enumerate(penalties)]
    overrides = {"disable_radix_cache": not cache}
    batches: list[ForwardBatch] = []
    got, sched = inprocess.generate(
        runner, prompts, NEW_TOKENS, chunked_prefill_size=chunk, enable_mixed_chunk=True, sampler=base,
        scheduler_overrides=overrides, overlap=overlap, batches=batches, n=N,
    )  # fmt: skip
    singles = [msgspec.structs.replace(s, seed=s.seed + c) for s in base for c in range(N)]
    expected, _ = inprocess.generate(
        runner, [p for p in prompts for _ in range(N)], NEW_TOKENS, chunked_prefill_size=chunk,
        enable_mixed_chunk=True, sampler=singles, scheduler_overrides={"disable_radix_cache": True},
    )  # fmt: skip
    assert got == expected
    assert len({tuple(out) for out in got}) == len(got), "sampled choices differ"
    # Each prompt once, then one decode token per output token but the last (no stop token ends a
    # choice early, so overlap schedules no void row; the pool is large enough for no retraction).
    computed = sum(len(b.input_ids) for b in batches)
    assert computed == sum(len(p) for p in prompts) + sum(len(out) - 1 for out in got)
    assert sum(len(b.fork_req_pool_idx) for b in batches) == len(prompts) * (N - 1)
    assert bool(sum(len(b.copy_src) for b in batches)) == (
        not cache or any(len(p) % page_size for p in prompts)
    )
    assert sched.kv.available_pages == sched.config.num_pages, "pages leaked"
