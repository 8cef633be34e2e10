"""The tiny Gemma 4 (tests/gemma4_models.py: every option on, two KV-shared layers) served through real
engine processes equals HF's greedy tokens: prompts past its window sent together into a pool so small
that requests are retracted (mixed batches of chunked prefills and decodes), then prompts sharing a
cached prefix, each as n = 2 choices."""

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
from tests.exactness.test_moe import hf_greedy
from tests.gemma4_models import save_gemma4
from tests.integration.engine import RunningEngine, running_engine
from tests.models import VOCAB

NEW_TOKENS = 16
FLAGS = ("--dtype", "float64", "--chunked-prefill-size", "8", "--page-size", "4", "--enable-mixed-chunk",
         "--kv-cache-tokens", "96", "--schedule-conservativeness", "0.05",
         "--new-token-ratio-decay-steps", "4", "--num-threads", "1")  # fmt: skip


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Iterator[tuple[RunningEngine, Any]]:
    """(an engine serving the tiny Gemma 4, the HF reference of the same weights)."""
    path = tmp_path_factory.mktemp("gemma4-served")
    hf = save_gemma4(path, seed=2)
    for name in TOKENIZER_FILES:  # ids below VOCAB decode as SmolLM2's tokens: text is not compared
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, path / name)
    with running_engine(path, tmp_path_factory.mktemp("gemma4-engine"), *FLAGS) as engine:
        yield engine, hf


async def _greedy_together(endpoint: str, prompts: list[list[int]], n: int = 1) -> list[list[GenerateOutput]]:
    async with AsyncClient(endpoint, timeout_s=240) as client:
        return await asyncio.gather(
            *(
                client.generate_choices(
                    input_ids=p, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, n=n
                )
                for p in prompts
            )
        )


@pytest.mark.timeout(600)
def test_served_batches_retraction_prefix_hits_and_choices_match_hf(
    served: tuple[RunningEngine, Any],
) -> None:
    engine, hf = served
    rng = random.Random(11)
    prompts = [[rng.randrange(3, VOCAB - 8) for _ in range(n)] for n in (34, 2, 27, 21, 30)]
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    got = asyncio.run(_greedy_together(engine.endpoint, prompts))
    assert [choices[0].token_ids for choices in got] == expected
    assert "retracted rid" in engine.log(), "the tiny pool must retract requests"
    # Two prompts sharing the first prompt's first 24 tokens: one at least reads them from the radix
    # cache (the tiny pool may have evicted the first prompt's pages; then the other's).
    again = [prompts[0][:24] + [rng.randrange(3, VOCAB - 8) for _ in range(k)] for k in (3, 6)]
    expected = hf_greedy(hf, again, NEW_TOKENS)
    got = asyncio.run(_greedy_together(engine.endpoint, again, n=2))
    assert [[c.token_ids for c in choices] for choices in got] == [[e, e] for e in expected]
    cached = [c.usage.cached_tokens for choices in got for c in choices if c.usage is not None]
    assert cached and max(cached) >= 20, f"the shared prefix must come from the cache: {cached}"
    assert len({tuple(e) for e in expected}) == 2, "the reference must not be degenerate"
