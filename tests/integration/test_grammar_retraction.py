"""Grammar requests on the embedded SmolLM2 with a KV pool so small that they are retracted and
recomputed while the overlap scheduler runs ahead: their tokens equal those of each request
served alone, and every output is the schema's JSON."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from client import Client, Grammar
from protocol.messages import FinishReason, GenerateOutput
from tests.integration.engine import RunningEngine, running_engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "size": {"enum": ["small", "medium", "large"]},
    },
    "required": ["name", "tags", "size"],
}
TOPICS = ["a cat", "a city", "a car", "a tree", "a river", "a song"]


@pytest.fixture(scope="module")
def tiny_pool(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEngine]:
    flags = ("--kv-cache-tokens", "256", "--page-size", "16", "--schedule-conservativeness", "0.05",
             "--new-token-ratio-decay-steps", "4", "--enable-mixed-chunk",
             "--chunked-prefill-size", "64")  # fmt: skip
    with running_engine(None, tmp_path_factory.mktemp("grammar-retraction"), *flags) as e:
        yield e


def describe(engine: RunningEngine, topic: str) -> GenerateOutput:
    with Client(engine.endpoint, timeout_s=240) as c:
        messages = [{"role": "user", "content": f"Describe {topic} as JSON."}]
        grammar = Grammar(kind="json_schema", spec=json.dumps(SCHEMA))
        return c.generate(messages=messages, max_new_tokens=80, temperature=0, grammar=grammar)


@pytest.mark.timeout(600)
def test_retracted_grammar_requests_keep_their_tokens(tiny_pool: RunningEngine) -> None:
    alone = [describe(tiny_pool, topic) for topic in TOPICS]
    assert "retracted rid" not in tiny_pool.log(), "one request at a time fits the pool"
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        together = list(pool.map(lambda topic: describe(tiny_pool, topic), TOPICS))
    assert "retracted rid" in tiny_pool.log(), "the tiny pool must retract requests"
    assert [out.token_ids for out in together] == [out.token_ids for out in alone]
    for out in together:
        assert out.finish_reason is FinishReason.STOP
        assert set(json.loads(out.text)) == set(SCHEMA["properties"])


@pytest.mark.timeout(300)
def test_a_limit_beyond_the_pool_runs_to_the_pools_length(tiny_pool: RunningEngine) -> None:
    """The pool (256 tokens) is shorter than the model's context (8192): the engine serves the pool's
    length, so a request whose limit only the context would allow runs until it fills the pool,
    where before the scheduler refused it whole ("needs more KV than the whole pool")."""
    with Client(tiny_pool.endpoint, timeout_s=240) as c:
        out = c.generate("Tell me a long story.", max_new_tokens=100_000, temperature=0, ignore_eos=True)
    assert out.finish_reason is FinishReason.LENGTH and out.usage is not None
    assert out.usage.prompt_tokens + out.usage.completion_tokens == 256
    assert "context 256" in tiny_pool.log()
