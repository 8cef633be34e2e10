"""The tiny gpt-oss (test_gpt_oss.py) served through real engine processes equals HF's greedy tokens:
prompts longer than its window sent together (mixed batches of chunked prefills and decodes), then
prompts sharing a cached prefix, then n = 2 choices of one prompt."""

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
from tests.exactness.test_gpt_oss import VOCAB, hf_gpt_oss, make_prompts, tiny_gpt_oss_config
from tests.exactness.test_moe import hf_greedy
from tests.integration.engine import RunningEngine, running_engine

NEW_TOKENS = 6
FLAGS = ("--dtype", "float64", "--chunked-prefill-size", "8", "--page-size", "4", "--enable-mixed-chunk")


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Iterator[tuple[RunningEngine, Any]]:
    """(an engine serving a tiny gpt-oss, the HF reference of the same weights)."""
    path = tmp_path_factory.mktemp("gpt-oss-served")
    hf = hf_gpt_oss(tiny_gpt_oss_config(layers=2), seed=1)
    hf.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:  # ids below VOCAB decode as SmolLM2's tokens: text is not compared
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, path / name)
    with running_engine(path, tmp_path_factory.mktemp("gpt-oss-engine"), *FLAGS) as engine:
        yield engine, hf


async def _greedy_together(endpoint: str, prompts: list[list[int]], n: int = 1) -> list[list[GenerateOutput]]:
    async with AsyncClient(endpoint, timeout_s=120) as client:
        replies = await asyncio.gather(
            *(
                client.generate_choices(
                    input_ids=p, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, n=n
                )
                for p in prompts
            )
        )
    return replies


@pytest.mark.timeout(300)
def test_served_batches_prefix_hits_and_choices_match_hf(served: tuple[RunningEngine, Any]) -> None:
    engine, hf = served
    prompts = make_prompts(seed=11, lens=(30, 2, 19, 11))
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
