"""Speculative decoding served by the engine (scheduler core + model runner, no sockets): every
request draws exactly the tokens it draws without drafts, greedy and seeded-sampled, in float64,
over the exactness matrix: chunked prefill, prefix cache, mixed batches, retraction, the overlap
scheduler, n > 1, penalties, grammars, stop tokens and stop strings, and the logprobs of kept drafts.

A random model seldom repeats its prompt, so these tests draft with an oracle: each request's
reference continuation (its output without drafts), wrong at a position that varies by step, so
verify rows keep all of their drafts, some, or none. One test drafts by the n-gram lookup itself.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from protocol.grammar import Grammar
from protocol.messages import FinishReason, FinishReq, ForwardBatch, GenerateOutput, TokenBatch
from protocol.sampling import WorkerPenalties, WorkerSampling
from scheduler_proc.scheduler import Scheduler
from scheduler_proc.speculative import DraftState, NgramIndex
from tests.exactness import inprocess
from tests.models import VOCAB, save_tiny_model
from tokenizer_proc.detokenizer import IncrementalDetokenizer
from tokenizer_proc.model_info import load_tokenizer
from tokenizer_proc.request_table import RequestTable
from tokenizer_proc.validation import ValidRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

NEW_TOKENS = 24
SPECULATE = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 5}


class OracleDraft(DraftState):
    """Drafts the request's reference continuation, up to ``max_tokens``, a random length, with one
    token changed at a random place (or none); never pauses."""

    def __init__(self, prompt_len: int, reference: list[int], seed: int, vocab: int) -> None:
        super().__init__(NgramIndex(1, 1))
        self.prompt_len, self.reference, self.vocab = prompt_len, reference, vocab
        self.rng = random.Random(seed)

    def propose(self, new_tokens: list[int], max_tokens: int, first_length: int | None = None) -> list[int]:
        self.index.tokens.extend(new_tokens)  # keeps num_known
        done = len(self.index.tokens) - self.prompt_len  # outputs so far; the last one is the row's input
        draft = self.reference[done : done + self.rng.randint(1, max(max_tokens, 1))][:max_tokens]
        wrong = self.rng.randint(0, len(draft) + 1)  # past the end: every draft right
        if wrong < len(draft):
            draft[wrong] = (draft[wrong] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
        return draft

    def on_verified(self, drafted: int, accepted: int, floor: float) -> None:
        self.num_drafted += drafted
        self.num_accepted += accepted


class ReferenceDraft(OracleDraft):
    """Drafts the next ``max_tokens`` of the reference as they are: every verify row keeps them all."""

    def propose(self, new_tokens: list[int], max_tokens: int, first_length: int | None = None) -> list[int]:
        self.index.tokens.extend(new_tokens)
        done = len(self.index.tokens) - self.prompt_len
        return self.reference[done : done + max_tokens]


def oracle(
    references: list[list[int]], vocab: int = VOCAB, seed: int = 0, draft: type[OracleDraft] = OracleDraft
) -> Any:
    """An ``on_added`` hook: every drafting request drafts its reference (by rid) with ``draft``."""

    def install(scheduler: Scheduler) -> None:
        for rid, req in scheduler.reqs.items():
            if req.draft is not None:
                req.draft = draft(len(req.input_ids), references[rid], seed * 1000 + rid, vocab)

    return install


def flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


def check_drafted(scheduler: Scheduler) -> None:
    """Drafts were sent, and verify rows kept all, some and none of theirs over the run."""
    assert scheduler.num_draft_tokens > 0, "no verify row was sent"
    assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens
    assert scheduler.kv.used_tokens == 0, "every page must be free once all requests finished"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama-speculative")
    save_tiny_model("llama", False, path)
    return path


def runner(path: Path, page_size: int = 4, **config: Any) -> ModelRunner:
    return ModelRunner(
        WorkerConfig(model_path=str(path), dtype="float64", page_size=page_size, kv_cache_tokens=1024,
                     num_threads=1, **config)
    )  # fmt: skip


def shared_prompts(seed: int = 3) -> list[list[int]]:
    """Prompts of mixed lengths sharing prefixes (prefix-cache hits), one repeated."""
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(37)]
    prompts = [system + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 9, 22)]
    prompts += [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 5, 60)]
    return [*prompts, prompts[1]]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("chunked_prefill_size", [5, 256])
@pytest.mark.parametrize("mixed", [False, True], ids=["alternate", "mixed"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_greedy_tokens_unchanged(
    model_dir: Path, page_size: int, chunked_prefill_size: int, mixed: bool, overlap: bool
) -> None:
    prompts = shared_prompts()
    kwargs: dict[str, Any] = dict(chunked_prefill_size=chunked_prefill_size, enable_mixed_chunk=mixed)
    ref, _ = inprocess.generate(runner(model_dir, page_size), prompts, NEW_TOKENS, **kwargs)
    got, scheduler = inprocess.generate(
        runner(model_dir, page_size), prompts, NEW_TOKENS, overlap=overlap, scheduler_overrides=SPECULATE,
        on_added=oracle(ref), **kwargs,
    )  # fmt: skip
    assert got == ref
    check_drafted(scheduler)


def test_retraction_and_a_small_pool(model_dir: Path) -> None:
    """A pool so small that requests are retracted and recomputed; drafts take only the pages the
    decodes leave, and a verify row's pages past what it kept are given back."""
    prompts = shared_prompts(seed=8)
    kwargs: dict[str, Any] = dict(chunked_prefill_size=16, enable_mixed_chunk=True)
    # 160 tokens for ~420 of prompts and outputs, admitted with next to no reservation
    small = {"num_pages": 40, "schedule_conservativeness": 0.05}
    ref, base = inprocess.generate(
        runner(model_dir), prompts, NEW_TOKENS, scheduler_overrides=small, **kwargs
    )
    got, scheduler = inprocess.generate(
        runner(model_dir), prompts, NEW_TOKENS, scheduler_overrides={**small, **SPECULATE},
        on_added=oracle(ref), overlap=True, **kwargs,
    )  # fmt: skip
    assert base.num_retracted > 0 and scheduler.num_retracted > 0, "the pool must force retraction"
    assert got == ref
    check_drafted(scheduler)


def with_and_without_drafts(
    model_dir: Path, prompts: list[list[int]], kwargs: dict[str, Any]
) -> tuple[list[list[int]], list[list[float]], list[list[int]], list[list[float]], Scheduler]:
    """``prompts`` served plainly, then speculating (overlapped) with the plain outputs as oracle
    drafts: (tokens, logprobs, the speculating run's tokens, its logprobs, its scheduler)."""
    ref_logprobs: list[list[float]] = []
    ref, _ = inprocess.generate(runner(model_dir), prompts, NEW_TOKENS, logprobs=ref_logprobs, **kwargs)
    got_logprobs: list[list[float]] = []
    got, scheduler = inprocess.generate(
        runner(model_dir), prompts, NEW_TOKENS, scheduler_overrides=SPECULATE, on_added=oracle(ref),
        logprobs=got_logprobs, overlap=True, **kwargs,
    )  # fmt: skip
    return ref, ref_logprobs, got, got_logprobs, scheduler


def sampled(seed: int, **options: Any) -> WorkerSampling:
    fields: dict[str, Any] = dict(temperature=0.9, top_k=-1, top_p=1.0, min_p=0.0, seed=seed)
    return WorkerSampling(**{**fields, **options})


@pytest.mark.parametrize(
    "filters", [{}, {"top_k": 20, "top_p": 0.9}, {"min_p": 0.05}], ids=["plain", "topk-topp", "minp"]
)
def test_seeded_sampling_draws_the_same_tokens(model_dir: Path, filters: dict[str, Any]) -> None:
    """A verify row draws each position with the noise a decode row there would (sampler.py), and
    keeps a draft exactly when that draw equals it: seeded requests draw the same tokens, with
    their logprobs, as without drafts; n > 1 choices too."""
    prompts = shared_prompts(seed=4)[:5]
    samplers = [sampled(100 + i, logprobs=i % 2 == 0, **filters) for i in range(len(prompts))]
    kwargs: dict[str, Any] = dict(chunked_prefill_size=16, enable_mixed_chunk=True, sampler=samplers, n=2)
    ref, ref_logprobs, got, got_logprobs, scheduler = with_and_without_drafts(model_dir, prompts, kwargs)
    assert got == ref
    assert any(got_logprobs) and flat(got_logprobs) == pytest.approx(flat(ref_logprobs), abs=1e-9)
    assert [len(lp) for lp in got_logprobs] == [len(lp) for lp in ref_logprobs]
    check_drafted(scheduler)


PENALTIES = [
    None,
    dict(presence=-2.0, frequency=0.5),
    dict(repetition=1.8),
    dict(bias_ids=[5, 40, 123], bias_values=[2.5, -100.0, 4.0], min_tokens=6, min_tokens_ids=[77]),
]


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_penalties_count_the_kept_drafts(model_dir: Path, temperature: float) -> None:
    """A verify row's draw at a drafted position sees the penalty counts of the drafts before it
    (and min_tokens' mask by its own position); the counts then follow the drafts it kept."""
    prompts = shared_prompts(seed=6)
    samplers = []
    for i, prompt in enumerate(prompts):
        config = PENALTIES[i % len(PENALTIES)]
        penalties = None if config is None else WorkerPenalties(prompt_len=len(prompt), **config)
        samplers.append(WorkerSampling(temperature=temperature, top_k=-1, top_p=1.0, min_p=0.0, seed=7 + i,
                                       penalties=penalties, logprobs=True))  # fmt: skip
    kwargs: dict[str, Any] = dict(chunked_prefill_size=8, enable_mixed_chunk=True, sampler=samplers,
                                  stop_token_ids=(77,))  # fmt: skip
    ref, ref_logprobs, got, got_logprobs, scheduler = with_and_without_drafts(model_dir, prompts, kwargs)
    assert got == ref
    assert flat(got_logprobs) == pytest.approx(flat(ref_logprobs), abs=1e-9)
    check_drafted(scheduler)


def test_stop_tokens_end_a_request_inside_its_drafts(model_dir: Path) -> None:
    """A stop token among the kept drafts ends the request there: the tokens after it are never
    emitted, and its KV past the stop is given back."""
    prompts = shared_prompts(seed=9)
    ref, _ = inprocess.generate(
        runner(model_dir), prompts, 40, chunked_prefill_size=256, enable_mixed_chunk=True
    )
    stops = tuple({out[12] for out in ref})  # each request stops at its 13th token or earlier
    kwargs: dict[str, Any] = dict(chunked_prefill_size=256, enable_mixed_chunk=True, stop_token_ids=stops)
    ref, _ = inprocess.generate(runner(model_dir), prompts, 40, **kwargs)
    assert all(len(out) <= 13 and out[-1] in stops for out in ref)
    always_right = oracle([out + [0] * 40 for out in ref], seed=1)
    got, scheduler = inprocess.generate(
        runner(model_dir), prompts, 40, scheduler_overrides=SPECULATE, on_added=always_right, **kwargs
    )
    assert got == ref
    assert scheduler.kv.used_tokens == 0


GREEDY_LOGPROBS = WorkerSampling(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0, logprobs=True)


class Detokenizing:
    """The tokenizer process's RequestTable on an ``inprocess.generate`` run (its ``on_tokens``):
    request i is client rid "i", greedy with logprobs, ``stops[i]`` its stop strings, streamed when
    i is odd. Keeps each request's replies and the tokens each TokenBatch brought it."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]], stops: list[str]
    ) -> None:
        self.table = RequestTable(tokenizer)
        for i, (prompt, stop) in enumerate(zip(prompts, stops, strict=True)):
            valid = ValidRequest(client_rid=str(i), input_ids=prompt, max_new_tokens=NEW_TOKENS,
                                 stop_token_ids=[], stop=(stop,), sampler=GREEDY_LOGPROBS, stream=i % 2 == 1,
                                 logprobs=True)  # fmt: skip
            assert self.table.add(b"client", valid).rid == i, "the table numbers rids as generate does"
        self.replies: dict[str, list[GenerateOutput]] = defaultdict(list)
        self.batches: dict[int, list[list[int]]] = defaultdict(list)  # rid -> its tokens per TokenBatch

    def __call__(self, batch: TokenBatch) -> list[FinishReq]:
        rows: dict[int, list[int]] = defaultdict(list)
        for rid, token in zip(batch.rids, batch.token_ids, strict=True):
            if token >= 0:
                rows[rid].append(token)
        for rid, tokens in rows.items():
            self.batches[rid].append(tokens)
        out = self.table.on_token_batch(batch)
        for _, reply in out.replies:
            self.replies[reply.rid].append(reply)
        return [msg for msg in out.to_scheduler if isinstance(msg, FinishReq)]

    def result(self, i: int) -> tuple[str, list[int], FinishReason | None, list[float]]:
        """Request i's text, token ids, finish reason and logprobs, over all its replies."""
        replies = self.replies[str(i)]
        assert all(r.finish_reason is None for r in replies[:-1]), "one final reply, the last"
        logprobs = [lp for r in replies for lp in r.logprobs or []]
        return "".join(r.text for r in replies), [t for r in replies for t in r.token_ids], \
            replies[-1].finish_reason, logprobs  # fmt: skip

    def batch_of(self, rid: int, index: int) -> tuple[int, int]:
        """(the TokenBatch that brought output token ``index`` of ``rid``, how many of its tokens
        came after that one in it)."""
        seen = 0
        for number, tokens in enumerate(self.batches[rid]):
            if index < seen + len(tokens):
                return number, seen + len(tokens) - index - 1
            seen += len(tokens)
        raise AssertionError(f"rid {rid} never got output token {index}")


def stop_across(tokenizer: PreTrainedTokenizerBase, output: list[int], first: int, last: int) -> str:
    """A stop string from the last character of output token ``first``'s text to the first of token
    ``last``'s (every token between whole): token ``last`` completes it, and it occurs nowhere earlier."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    texts = [detokenizer.add([token]) for token in output]
    assert texts[first] and texts[last], f"tokens {first} and {last} must have text: {texts}"
    stop = texts[first][-1] + "".join(texts[first + 1 : last]) + texts[last][0]
    start = len("".join(texts[: first + 1])) - 1
    assert "".join(texts).find(stop) == start, f"{stop!r} occurs before token {first}: {texts}"
    return stop


def test_stop_strings_inside_and_across_kept_drafts(model_dir: Path, smollm2_dir: Path) -> None:
    """A stop string completed by a kept draft ends the request there, as the tokenizer process sees
    it: the same text, token ids, finish reason and logprobs as without drafts, whether the string
    lies inside one verify row's drafts or across two rows; the drafts kept past it are dropped."""
    tokenizer = load_tokenizer(str(smollm2_dir))  # the tiny model's ids (< 500: bytes, short merges)
    prompts = shared_prompts(seed=5)[:4]
    kwargs: dict[str, Any] = dict(chunked_prefill_size=256, enable_mixed_chunk=True, sampler=GREEDY_LOGPROBS)
    ref, _ = inprocess.generate(runner(model_dir), prompts, NEW_TOKENS, **kwargs)
    spans = [(1, 3), (5, 7), (8, 9), (0, 2)]  # (first, last) output token of each stop string
    stops = [stop_across(tokenizer, out, *span) for out, span in zip(ref, spans, strict=True)]
    plain = Detokenizing(tokenizer, prompts, stops)
    inprocess.generate(runner(model_dir), prompts, NEW_TOKENS, on_tokens=plain, overlap=True, **kwargs)
    spec = Detokenizing(tokenizer, prompts, stops)
    _, scheduler = inprocess.generate(
        runner(model_dir), prompts, NEW_TOKENS, scheduler_overrides=SPECULATE, overlap=True, on_tokens=spec,
        on_added=oracle(ref, draft=ReferenceDraft), **kwargs,
    )  # fmt: skip
    for i, (_, last) in enumerate(spans):
        text, ids, reason, logprobs = spec.result(i)
        want_text, want_ids, want_reason, want_logprobs = plain.result(i)
        assert (want_ids, want_reason) == (ref[i][: last + 1], FinishReason.STOP), f"request {i} plain"
        assert (text, ids, reason) == (want_text, want_ids, want_reason), f"request {i}"
        assert len(logprobs) == len(ids) and logprobs == pytest.approx(want_logprobs, abs=1e-9)
    # (TokenBatch, tokens after it there) of each stop string's first and last token; batch 0 brings
    # the prefill's token, each later one a verify row's kept drafts and its last draw
    where = [(spec.batch_of(i, first), spec.batch_of(i, last)) for i, (first, last) in enumerate(spans)]
    assert all(after > 0 for _, (_, after) in where), f"a kept draft completes each stop string: {where}"
    assert where[0][0][0] == where[0][1][0] == 1 and where[2][0][0] == where[2][1][0] == 2, where  # inside
    assert 1 == where[1][0][0] < where[1][1][0] and where[3][0][0] == 0 < where[3][1][0], where  # across
    assert scheduler.num_accepted_tokens == scheduler.num_draft_tokens > 0
    assert scheduler.kv.used_tokens == 0, "a request stopped by the tokenizer gives back its pages"


def test_drafts_stop_at_max_tokens_and_the_context(model_dir: Path) -> None:
    """A verify row never carries more drafts than the request may still emit, before its
    max_new_tokens or the context length."""
    prompts = shared_prompts(seed=2)
    plain: dict[str, Any] = dict(chunked_prefill_size=256, enable_mixed_chunk=True)
    ref, _ = inprocess.generate(runner(model_dir), prompts, 11, **plain)
    batches: list[ForwardBatch] = []
    got, scheduler = inprocess.generate(
        runner(model_dir), prompts, 11, scheduler_overrides={**SPECULATE, "speculative_num_draft_tokens": 8},
        on_added=oracle([out + [5] * 20 for out in ref], seed=2), batches=batches, **plain,
    )  # fmt: skip
    assert got == ref and all(len(out) == 11 for out in got)
    assert scheduler.num_draft_tokens > 0
    context = runner(model_dir).context_len
    for batch in batches:
        for i in range(len(batch.draft_lens)):
            assert batch.prefix_lens[i] + batch.extend_lens[i] <= context


GRAMMARS = [
    Grammar(kind="regex", spec="(yes|no)( (yes|no)){0,5}"),
    Grammar(kind="ebnf", spec='root ::= "[" [0-9] ("," [0-9])* "]"'),
    Grammar(kind="json_schema", spec=json.dumps({"type": "object", "properties": {"a": {"type": "string"}}})),
]


def test_grammar_masks_follow_the_kept_drafts(tiny_llama_dir: Path) -> None:
    """A grammar row's draw at a drafted position is masked by a matcher that took the drafts
    before it; a draft the grammar forbids is never kept (its draw there differs)."""
    from tokenizer_proc.grammar import GrammarCompiler

    compiler = GrammarCompiler(load_tokenizer(str(tiny_llama_dir)), 49152)
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (4, 17, 30, 9, 12, 25)]
    samplers = []
    for i, prompt in enumerate(prompts):
        grammar = compiler.compile_blocking(GRAMMARS[i % 3]).for_request([2], len(prompt)) if i < 4 else None
        samplers.append(WorkerSampling(temperature=0.8 * (i % 2), top_k=-1, top_p=1.0, min_p=0.0, seed=i,
                                       grammar=grammar))  # fmt: skip
    kwargs: dict[str, Any] = dict(chunked_prefill_size=8, enable_mixed_chunk=True, sampler=samplers,
                                  stop_token_ids=(2,))  # fmt: skip
    ref, _ = inprocess.generate(runner(tiny_llama_dir), prompts, NEW_TOKENS, **kwargs)
    got, scheduler = inprocess.generate(
        runner(tiny_llama_dir), prompts, NEW_TOKENS, scheduler_overrides=SPECULATE,
        on_added=oracle(ref, vocab=49152), overlap=True, **kwargs,
    )  # fmt: skip
    assert got == ref
    assert scheduler.num_draft_tokens > 0 and scheduler.num_accepted_tokens > 0


def test_ngram_lookup_drafts_what_the_output_repeats(model_dir: Path) -> None:
    """The n-gram lookup itself, on prompts whose continuation this model loops on: the same tokens
    as without drafts, and most drafts kept once the output repeats."""
    base = [17, 93, 4, 250, 61]
    prompts = [base * 8, [300, 301] * 12]
    kwargs: dict[str, Any] = dict(chunked_prefill_size=256, enable_mixed_chunk=True)
    ref, _ = inprocess.generate(runner(model_dir), prompts, 32, **kwargs)
    got, scheduler = inprocess.generate(
        runner(model_dir), prompts, 32, scheduler_overrides={**SPECULATE, "speculative_ngram_min_size": 1},
        overlap=True, **kwargs,
    )  # fmt: skip
    assert got == ref
    assert scheduler.num_draft_tokens > 0


LINES = "Number these lines:\napples\nbananas\ncherries\ndates\nelderberries\nfigs\ngrapes\n"


def test_the_embedded_model_copies_with_drafts_as_without_by_the_top2_rule(smollm2_dir: Path) -> None:
    """The production path (GGUF blocks, float32 activations, float16 KV, verify rows through the C
    kernel and the one-call decode): a prompt whose answer repeats its words (the 135M model does not
    copy code verbatim: its rewrites wander), drafted by the n-gram lookup, gives HF float32's greedy
    tokens by the top-2 rule (a verify row's positions take other matmul row counts than decode rows,
    so a near tie may flip), and most drafts are kept."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpu_worker.weights.model_files import source_gguf
    from tests.exactness.test_smollm2_bf16 import first_divergence_within_top2
    from tests.exactness.test_smollm2_fp32 import EOS, chat_prompt

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = chat_prompt(tokenizer, LINES)
    gguf = source_gguf(None)
    config = WorkerConfig(model_path=str(smollm2_dir), gguf_path=str(gguf), kv_cache_tokens=2048)
    (got,), scheduler = inprocess.generate(
        ModelRunner(config), [prompt], 64, chunked_prefill_size=256, enable_mixed_chunk=True,
        stop_token_ids=(EOS,), scheduler_overrides={"speculative_algorithm": "ngram"}, overlap=True,
    )  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)
    first_divergence_within_top2(hf, prompt, got, out[0, len(prompt) :].tolist())
    assert scheduler.num_accepted_tokens > scheduler.num_draft_tokens / 2 > 0
