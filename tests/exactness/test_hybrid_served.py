"""A tiny hybrid model (Qwen3.5's multimodal config: its language model served) through real engine
processes equals HF's greedy tokens: prompts sent together (mixed batches of chunked prefills and
decodes, the overlap schedule), a second chat turn extending the first's prompt and answer (a hit
resumed from a state checkpoint), and n = 2 choices of one prompt."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client import AsyncClient
from protocol import GenerateOutput
from tests.conftest import TOKENIZER_FILES
from tests.hybrid_models import hf_greedy, make_prompts, save_hybrid
from tests.integration.engine import RunningEngine, running_engine

NEW_TOKENS = 6
FLAGS = ("--dtype", "float64", "--chunked-prefill-size", "8", "--page-size", "4", "--enable-mixed-chunk",
         "--max-running-requests", "8")  # fmt: skip


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Iterator[tuple[RunningEngine, Any]]:
    """(an engine serving a tiny Qwen3.5, the HF reference of the same weights)."""
    path = tmp_path_factory.mktemp("qwen3_5-served")
    hf = save_hybrid("qwen3_5", path, seed=2)
    for name in TOKENIZER_FILES:  # ids below the vocabulary decode as SmolLM2's tokens: text is not compared
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, path / name)
    with running_engine(path, tmp_path_factory.mktemp("qwen3_5-engine"), *FLAGS) as engine:
        yield engine, hf


async def _greedy(endpoint: str, prompts: list[list[int]], n: int = 1) -> list[list[GenerateOutput]]:
    async with AsyncClient(endpoint, timeout_s=120) as client:
        return list(
            await asyncio.gather(
                *(
                    client.generate_choices(
                        input_ids=p, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, n=n
                    )
                    for p in prompts
                )
            )
        )


@pytest.mark.timeout(300)
def test_served_batches_chat_turns_and_choices_match_hf(served: tuple[RunningEngine, Any]) -> None:
    engine, hf = served
    prompts = make_prompts(21, (30, 2, 19, 11))
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    assert len({t for out in expected for t in out}) > NEW_TOKENS, "the reference must not be degenerate"
    got = asyncio.run(_greedy(engine.endpoint, prompts))
    assert [choices[0].token_ids for choices in got] == expected
    # The next turn of the first conversation: its prompt, its answer and a new message.
    second = [prompts[0] + expected[0] + make_prompts(22, (5,))[0]]
    again = asyncio.run(_greedy(engine.endpoint, second, n=2))
    want = hf_greedy(hf, second, NEW_TOKENS)[0]
    assert [c.token_ids for c in again[0]] == [want, want]
    cached = [c.usage.cached_tokens for c in again[0] if c.usage is not None]
    assert cached and min(cached) >= 32, f"the first turn's checkpoint must be hit: {cached}"
    assert "recurrent-state pool: 3 linear layers" in engine.log()
