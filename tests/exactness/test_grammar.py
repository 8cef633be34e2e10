"""Grammar rows served by the engine (scheduler core + model runner, no sockets): every grammar
row's tokens are accepted by its grammar, the free rows beside them are token-exact what they are
alone, and chunked prefill, a pool so small that requests are retracted (their matchers rebuilt
from their output, partly from a cached prefix), and the overlap scheduler's PENDING inputs change
no token.

A random 2-layer Llama with SmolLM2's vocabulary and tokenizer, in float64 (so batching changes no
greedy pick).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from protocol.grammar import Grammar
from protocol.messages import PENDING, ForwardBatch
from protocol.sampling import WorkerSampling
from tests.exactness import inprocess
from tests.models import GREEDY
from tokenizer_proc.grammar import GrammarCompiler
from tokenizer_proc.model_info import load_tokenizer

EOS = 2
NEW_TOKENS = 24
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"type": "string", "enum": ["s", "m", "l"]}},
    "required": ["ok", "size"],
}
GRAMMARS = [
    Grammar(kind="regex", spec="(yes|no)( (yes|no)){0,3}"),
    Grammar(kind="json_schema", spec=json.dumps(SCHEMA)),
    Grammar(kind="ebnf", spec='root ::= "[" [0-9] ("," [0-9])* "]"'),
    Grammar(kind="json_object"),
]

LONG_SCHEMA = Grammar(
    kind="json_schema",
    spec=json.dumps({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}),
)


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    systems = [[rng.randrange(100, 40000) for _ in range(n)] for n in (30, 45)]
    return [
        rng.choice(systems) + [rng.randrange(100, 40000) for _ in range(rng.randint(1, 9))] for _ in range(12)
    ]


def runner(path: Path, page_size: int) -> ModelRunner:
    config = WorkerConfig(
        model_path=str(path), dtype="float64", page_size=page_size, kv_cache_tokens=2048, num_threads=1
    )
    return ModelRunner(config)


def make_samplers(
    path: Path, grammar_rows: range, grammars: list[Grammar] = GRAMMARS
) -> list[WorkerSampling]:
    """Requests ``grammar_rows`` under ``grammars`` in turn, the others free."""
    compiler = GrammarCompiler(load_tokenizer(str(path)), 49152)
    base = {f: getattr(GREEDY, f) for f in GREEDY.__struct_fields__}
    out = []
    for i, prompt in enumerate(prompts()):
        grammar = None
        if i in grammar_rows:
            spec = compiler.compile_blocking(grammars[i % len(grammars)])
            grammar = spec.for_request([EOS], len(prompt))
        out.append(WorkerSampling(**{**base, "grammar": grammar}))
    return out


@pytest.fixture(scope="module")
def samplers(tiny_llama_dir: Path) -> list[WorkerSampling]:
    """Even requests under a grammar, odd ones free."""
    return make_samplers(tiny_llama_dir, range(0, 12, 2))


def serve(path: Path, samplers: list[WorkerSampling], rows: list[int], **kwargs: Any) -> dict[int, list[int]]:
    page_size = kwargs.pop("page_size", 16)
    got, sched = inprocess.generate(
        runner(path, page_size),
        [prompts()[i] for i in rows],
        NEW_TOKENS,
        chunked_prefill_size=16,
        stop_token_ids=(EOS,),
        sampler=[samplers[i] for i in rows],
        **kwargs,
    )
    assert sched.kv.available_pages == sched.config.num_pages, "pages leaked"
    return dict(zip(rows, got, strict=True))


@pytest.fixture(scope="module")
def together(tiny_llama_dir: Path, samplers: list[WorkerSampling]) -> dict[int, list[int]]:
    return serve(tiny_llama_dir, samplers, list(range(12)), enable_mixed_chunk=True)


def test_grammar_rows_follow_their_grammar(
    tiny_llama_dir: Path, samplers: list[WorkerSampling], together: dict[int, list[int]]
) -> None:
    import xgrammar

    checker = runner(tiny_llama_dir, 16).grammars.compiled
    ended = 0
    for i, tokens in together.items():
        grammar = samplers[i].grammar
        if grammar is None:
            continue
        matcher = xgrammar.GrammarMatcher(checker.get(grammar), override_stop_tokens=[EOS])
        assert all(matcher.accept_token(t) for t in tokens), f"request {i}: {tokens}"
        ended += tokens[-1] == EOS
        assert tokens[-1] != EOS or matcher.is_terminated()
    assert ended >= 2, "the finite grammars (regex, enum schema) end with EOS within NEW_TOKENS"


def test_free_rows_are_unchanged_by_grammar_rows_beside_them(
    tiny_llama_dir: Path, samplers: list[WorkerSampling], together: dict[int, list[int]]
) -> None:
    free = [i for i in range(12) if samplers[i].grammar is None]
    alone = serve(tiny_llama_dir, samplers, free, enable_mixed_chunk=True)
    assert all(alone[i] == together[i] for i in free)
    assert any(EOS not in together[i] for i in free), (
        "free rows run to the length limit: the test sees tokens"
    )


def test_retraction_and_overlap_change_no_token(tiny_llama_dir: Path) -> None:
    """Every request under a grammar that does not end soon (so the pool runs out)."""
    samplers = make_samplers(tiny_llama_dir, range(12), [GRAMMARS[2], GRAMMARS[3], LONG_SCHEMA])
    roomy = serve(tiny_llama_dir, samplers, list(range(12)), enable_mixed_chunk=False)
    batches: list[ForwardBatch] = []
    got = serve(
        tiny_llama_dir, samplers, list(range(12)), enable_mixed_chunk=True, page_size=4, overlap=True,
        scheduler_overrides={"num_pages": 40, "schedule_conservativeness": 0.2}, batches=batches,
    )  # fmt: skip
    assert got == roomy
    assert any(PENDING in b.input_ids for b in batches), "overlap must send PENDING decode inputs"
    given = [s for b in batches for s in b.sampler if s is not None]
    assert len(given) > 12, "the tiny pool must retract requests (their sampler sent again)"
    assert any(ids for b in batches for ids in b.prefix_ids), "a req_pool_idx must start from a cached prefix"
