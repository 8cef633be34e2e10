"""Grammar compilation in the tokenizer process (tokenizer_proc/grammar.py) and its validation:
every kind compiles, bad ones are rejected with xgrammar's reason, each distinct grammar compiles
once (concurrent requests share the compile) and off the event loop."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec
import pytest

from protocol.grammar import Grammar
from protocol.messages import AbortRequest, FinishReason, GenerateRequest, SamplingParams
from tokenizer_proc.frontend import Frontend
from tokenizer_proc.grammar import CompiledSpec, GrammarCompiler, GrammarRejected
from tokenizer_proc.model_info import ModelInfo
from tokenizer_proc.outbox import Outbox
from tokenizer_proc.validation import RequestRejected, validate_generate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
GOOD = [
    Grammar(kind="json_schema", spec=json.dumps(SCHEMA)),
    Grammar(kind="json_schema", spec=json.dumps(SCHEMA), strict=False),
    Grammar(kind="json_object"),
    Grammar(kind="regex", spec=r"\d{3}-[a-z]+"),
    Grammar(kind="ebnf", spec='root ::= "yes" | "no"'),
]
BAD = [
    (Grammar(kind="json_schema", spec="{not json"), "Failed to parse JSON"),
    (Grammar(kind="json_schema", spec=json.dumps({"type": "strin"})), 'Unsupported type "strin"'),
    (Grammar(kind="json_schema", spec=""), "needs a schema"),
    (Grammar(kind="regex", spec="a(b"), "parenthesis is not closed"),
    (Grammar(kind="ebnf", spec="root ::= foo"), 'Rule "foo" is not defined'),
]


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, model_info.vocab_size)


@pytest.mark.parametrize("grammar", GOOD, ids=lambda g: f"{g.kind}-{g.strict}")
def test_every_kind_compiles_and_is_cached(compiler: GrammarCompiler, grammar: Grammar) -> None:
    spec = compiler.compile_blocking(grammar)
    assert json.loads(spec.compiled), "xgrammar's compiled grammar travels as JSON text"
    assert compiler.cached(grammar) is spec
    assert compiler.cached(Grammar(kind=grammar.kind, spec=grammar.spec + " ", strict=grammar.strict)) is None


@pytest.mark.parametrize(("grammar", "reason"), BAD, ids=lambda x: getattr(x, "kind", ""))
def test_a_bad_grammar_is_rejected_with_xgrammar_s_reason(
    compiler: GrammarCompiler, grammar: Grammar, reason: str
) -> None:
    with pytest.raises(GrammarRejected, match=reason) as info:
        compiler.compile_blocking(grammar)
    assert "/project/" not in str(info.value) and "\n" not in str(info.value)


def test_concurrent_requests_share_one_compile_off_the_event_loop(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []

    def slow_compile(key: str, grammar: Grammar) -> CompiledSpec:
        calls.append(key)
        time.sleep(0.3)  # a slow schema, on a pool thread
        return CompiledSpec(key=key, compiled="{}")

    monkeypatch.setattr(compiler, "_compile_now", slow_compile)
    grammar = Grammar(kind="regex", spec="shared-[0-9]+")

    async def run() -> tuple[list[CompiledSpec], int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        specs = await asyncio.gather(*(compiler.compile(grammar) for _ in range(3)))
        ticker.cancel()
        return list(specs), ticks

    specs, ticks = asyncio.run(run())
    assert len(calls) == 1 and specs[0] is specs[1] is specs[2]
    assert ticks >= 10, "the event loop kept running while the grammar compiled"
    assert threading.current_thread() is threading.main_thread()


def _request(**sampling: Any) -> GenerateRequest:
    return GenerateRequest(rid="g", prompt="Hello there", sampling=SamplingParams(**sampling))


def test_validation_hands_the_worker_the_compiled_grammar(
    tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo, compiler: GrammarCompiler
) -> None:
    grammar = GOOD[0]
    spec = compiler.compile_blocking(grammar)
    valid = validate_generate(_request(grammar=grammar), tokenizer, model_info, random.Random(0), spec)
    worker = valid.sampler.grammar
    assert worker is not None and worker.key == spec.key and worker.compiled == spec.compiled
    assert worker.prompt_len == len(valid.input_ids) and worker.stop_token_ids == list(
        model_info.eos_token_ids
    )
    assert set(model_info.eos_token_ids) <= set(valid.stop_token_ids), "EOS ends a grammar's request"
    free = validate_generate(_request(), tokenizer, model_info, random.Random(0))
    assert free.sampler.grammar is None and not free.sampler.needs_prefix_ids


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 2}, "min_tokens")],
)
def test_grammar_conflicts_are_rejected(
    tokenizer: PreTrainedTokenizerBase,
    model_info: ModelInfo,
    compiler: GrammarCompiler,
    fields: dict[str, Any],
    message: str,
) -> None:
    grammar = GOOD[2]
    spec = compiler.compile_blocking(grammar)
    with pytest.raises(RequestRejected, match=rf"sampling\.grammar .*{message}"):
        validate_generate(_request(grammar=grammar, **fields), tokenizer, model_info, random.Random(0), spec)


def test_a_zmq_request_is_admitted_after_its_compile_unless_aborted_meanwhile(
    tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo
) -> None:
    frontend = Frontend(tokenizer, model_info, seed=0)
    grammar = Grammar(kind="regex", spec="zmq-[0-9]+")

    def send(msg: Any) -> Outbox:
        return frontend.on_client_frames([b"client-1", msgspec.msgpack.encode(msg)])

    def request(rid: str) -> GenerateRequest:
        return GenerateRequest(rid=rid, prompt="hi", sampling=SamplingParams(grammar=grammar))

    async def run() -> list[Outbox]:
        first = send(request("a"))
        assert first.to_compile and not first.to_scheduler, "not compiled yet: the process compiles it"
        task = asyncio.create_task(frontend.admit_after_compile(first.to_compile[0]))
        second = send(request("b"))
        assert second.to_compile
        twice = send(request("b"))
        aborted = send(AbortRequest(rid="b"))
        admitted = await task
        late = await frontend.admit_after_compile(second.to_compile[0])
        return [admitted, twice, aborted, late, send(request("c"))]

    admitted, twice, aborted, late, cached = asyncio.run(run())
    assert len(admitted.to_scheduler) == 1
    assert "in flight" in (twice.replies[0][1].error or "")
    assert aborted.replies[0][1].finish_reason is FinishReason.ABORT
    assert late == Outbox(), "a request aborted while its grammar compiled is never admitted"
    assert len(cached.to_scheduler) == 1 and not cached.to_compile, "a cached grammar is admitted at once"


def test_a_compiler_fault_is_an_error_reply(
    tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    frontend = Frontend(tokenizer, model_info, seed=0)

    def broken(key: str, grammar: Grammar) -> CompiledSpec:
        raise RuntimeError("compiler fault")

    monkeypatch.setattr(frontend.grammars, "_compile_now", broken)
    req = GenerateRequest(rid="f", prompt="hi", sampling=SamplingParams(grammar=Grammar(kind="json_object")))
    out = asyncio.run(frontend.admit_after_compile(frontend.intake.begin(b"client-1", req)))
    assert not out.to_scheduler and "compiler fault" in (out.replies[0][1].error or "")
