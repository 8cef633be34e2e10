"""A tiny DeepSeek-V3 (tests/mla_models.py: latent attention, sigmoid group routing with the
score-correction bias) served through real engine processes equals HF's float64 greedy tokens: prompts
sent together (mixed batches of chunked prefills and decodes), prompts sharing a cached prefix with
n = 2 choices, and more requests than the tiny latent pool holds (retraction)."""

from __future__ import annotations

import asyncio
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client import AsyncClient
from protocol import GenerateOutput
from tests.conftest import TOKENIZER_FILES
from tests.integration.engine import RunningEngine, running_engine
from tests.mla_models import VOCAB, hf_greedy, make_prompts, save_mla_model

NEW_TOKENS = 6
# 128 tokens of pool: the retraction test's six requests need twice that at once
FLAGS = ("--dtype", "float64", "--chunked-prefill-size", "8", "--page-size", "4", "--enable-mixed-chunk",
         "--kv-cache-tokens", "128", "--schedule-conservativeness", "0.05",
         "--new-token-ratio-decay-steps", "4")  # fmt: skip


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Iterator[tuple[RunningEngine, Any]]:
    """(an engine serving the tiny V3, the HF reference of the same weights)."""
    path = tmp_path_factory.mktemp("mla-served")
    hf = save_mla_model("v3", path, seed=1)
    for name in TOKENIZER_FILES:  # ids below VOCAB decode as SmolLM2's tokens: text is not compared
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, path / name)
    with running_engine(path, tmp_path_factory.mktemp("mla-engine"), *FLAGS) as engine:
        yield engine, hf


async def _greedy_together(
    endpoint: str, prompts: list[list[int]], n: int = 1, new_tokens: int = NEW_TOKENS
) -> list[list[GenerateOutput]]:
    async with AsyncClient(endpoint, timeout_s=240) as client:
        replies = await asyncio.gather(
            *(
                client.generate_choices(
                    input_ids=p, max_new_tokens=new_tokens, temperature=0, ignore_eos=True, n=n
                )
                for p in prompts
            )
        )
    return replies


@pytest.mark.timeout(300)
def test_served_batches_prefix_hits_and_choices_match_hf(served: tuple[RunningEngine, Any]) -> None:
    engine, hf = served
    assert "bytes a token, latent" in engine.log(), "the start log gives the latent pool's size"
    prompts = make_prompts(11, (30, 2, 19, 11))
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    got = asyncio.run(_greedy_together(engine.endpoint, prompts))
    assert [choices[0].token_ids for choices in got] == expected
    rng = random.Random(12)  # the first prompt's first 24 tokens are cached now: prefix hits
    again = [prompts[0][:24] + [rng.randrange(3, VOCAB) for _ in range(k)] for k in (3, 9)]
    expected = hf_greedy(hf, again, NEW_TOKENS)
    got = asyncio.run(_greedy_together(engine.endpoint, again, n=2))
    assert [[c.token_ids for c in choices] for choices in got] == [[e, e] for e in expected]
    cached = [c.usage.cached_tokens for choices in got for c in choices if c.usage is not None]
    assert cached and min(cached) >= 20, f"the shared prefix must come from the cache: {cached}"
    assert len({tuple(e) for e in expected}) == 2, "the reference must not be degenerate"


@pytest.mark.timeout(300)
def test_retracted_requests_match_hf(served: tuple[RunningEngine, Any]) -> None:
    """Six requests of 12-16 + 28 tokens in a 128-token pool: some are retracted and recomputed."""
    engine, hf = served
    prompts = make_prompts(21, (14, 16, 12, 15, 13, 16))
    expected = hf_greedy(hf, prompts, 28)
    got = asyncio.run(_greedy_together(engine.endpoint, prompts, new_tokens=28))
    assert "retracted rid" in engine.log(), "the tiny pool must retract requests"
    assert [choices[0].token_ids for choices in got] == expected
