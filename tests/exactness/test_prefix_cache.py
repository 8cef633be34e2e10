"""The prefix cache changes which KV is computed, never the tokens: cache on == cache off, real model.

A tiny random Llama in float64; prompts share long prefixes (and some are identical),
chunked prefill, and a KV pool so small that cached prefixes are evicted and running
requests retracted.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from tests.exactness import inprocess
from tests.models import VOCAB, save_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama-cache")
    save_tiny_model("llama", False, path)
    return path


def shared_prefix_prompts() -> list[list[int]]:
    rng = random.Random(11)
    systems = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (40, 70)]
    prompts = [
        rng.choice(systems) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(10)
    ]
    return prompts + [prompts[0], prompts[3]]  # identical prompts too


@pytest.mark.parametrize(
    ("page_size", "mixed"), [(1, False), (16, True)], ids=["page1-alternate", "page16-mixed"]
)
def test_cache_on_and_off_give_the_same_tokens(tiny_llama: Path, page_size: int, mixed: bool) -> None:
    runner = ModelRunner(
        WorkerConfig(
            model_path=str(tiny_llama),
            dtype="float64",
            page_size=page_size,
            kv_cache_tokens=2048,
            num_threads=1,
        )
    )
    prompts = shared_prefix_prompts()
    tiny = {"num_pages": 160 // page_size, "schedule_conservativeness": 0.2}  # 160 tokens of KV
    outputs = {}
    for cache in (True, False):
        outputs[cache], sched = inprocess.generate(
            runner,
            prompts,
            24,
            chunked_prefill_size=16,
            enable_mixed_chunk=mixed,
            scheduler_overrides={**tiny, "disable_radix_cache": not cache},
        )
        if cache:
            assert sched.kv.cache is not None and sched.kv.cache.num_evicted_pages > 0, "no eviction"
            assert sched.num_cached_prompt_tokens > 0, "no cache hit"
        assert sched.num_retracted > 0, "the tiny pool must force retraction too"
        assert sched.kv.available_pages == sched.config.num_pages, "pages leaked"
    assert outputs[True] == outputs[False]
    assert all(len(out) == 24 for out in outputs[True])
