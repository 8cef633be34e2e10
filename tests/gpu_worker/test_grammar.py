"""The worker's grammar masks (gpu_worker/sampling/grammar.py) on the embedded model's real vocabulary: a
matcher per req_pool_idx that follows the tokens the worker runs, through a req_pool_idx given anew, a
cached prefix (retraction), the void row after EOS and a token the grammar rejects; free rows untouched."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import pytest
import torch

from gpu_worker.sampling.grammar import GrammarError, ReqPoolGrammars
from protocol.grammar import Grammar
from protocol.messages import ForwardBatch
from protocol.sampling import WorkerSampling
from tests.models import GREEDY
from tokenizer_proc.grammar import GrammarCompiler
from tokenizer_proc.model_info import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

VOCAB = 49152
EOS = 2
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(str(smollm2_dir))


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerBase) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB)


@pytest.fixture
def grammars(smollm2_dir: Path) -> ReqPoolGrammars:
    return ReqPoolGrammars(4, VOCAB, str(smollm2_dir))


def sampler(
    compiler: GrammarCompiler, grammar: Grammar | None, prompt_len: int = len(PROMPT)
) -> WorkerSampling:
    worker = None if grammar is None else compiler.compile_blocking(grammar).for_request([EOS], prompt_len)
    return WorkerSampling(**{**{f: getattr(GREEDY, f) for f in GREEDY.__struct_fields__}, "grammar": worker})


def batch(rows: list[tuple[int, int, list[int], WorkerSampling | None]], **extra: Any) -> ForwardBatch:
    """One row per (req_pool_idx, prefix_len, input ids, sampler or None), every row sampled."""
    return ForwardBatch(
        step=0, req_pool_idx=[r[0] for r in rows], prefix_lens=[r[1] for r in rows],
        extend_lens=[len(r[2]) for r in rows], input_ids=[t for r in rows for t in r[2]],
        page_starts=[0] * len(rows), page_counts=[0] * len(rows), pages=[], sample=[True] * len(rows),
        sampler=[r[3] for r in rows], **extra,
    )  # fmt: skip


def allowed(grammars: ReqPoolGrammars, b: ForwardBatch, row: int = 0) -> set[int]:
    """The tokens row ``row`` may draw after ``b`` ran (its logits all 0 before the mask)."""
    grammars.update(b, torch.tensor(b.input_ids))
    logits = grammars.apply(torch.zeros(len(b.req_pool_idx), VOCAB), b.req_pool_idx)
    return set(torch.nonzero(logits[row] == 0).flatten().tolist())


def token(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    ids = tokenizer.encode(text)
    assert len(ids) == 1, f"{text!r} is one token of SmolLM2"
    return int(ids[0])


def test_the_mask_follows_the_generated_tokens_to_eos(
    grammars: ReqPoolGrammars, compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    s = sampler(compiler, Grammar(kind="regex", spec="(yes|no)!"))
    first = allowed(grammars, batch([(1, 0, PROMPT, s)]))
    texts = {str(tokenizer.decode([t])) for t in first}
    assert first and all("yes!".startswith(t) or "no!".startswith(t) for t in texts), texts
    assert {"yes", "no"} <= texts and EOS not in first
    after_yes = allowed(grammars, batch([(1, 3, [token(tokenizer, "yes")], None)]))
    assert after_yes == {token(tokenizer, "!")}
    assert allowed(grammars, batch([(1, 4, [token(tokenizer, "!")], None)])) == {EOS}
    # The void row scheduled after the last token: its input is EOS, the matcher has terminated.
    assert allowed(grammars, batch([(1, 5, [EOS], None)])) == {EOS}


def test_a_retracted_request_rebuilds_its_matcher_from_its_output(
    grammars: ReqPoolGrammars, compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    """A req_pool_idx given anew with a cached prefix (prompt + "yes") and the recompute's last input."""
    s = sampler(compiler, Grammar(kind="regex", spec="(yes|no)!"))
    yes, bang = token(tokenizer, "yes"), token(tokenizer, "!")
    assert allowed(grammars, batch([(2, 4, [bang], s)], prefix_ids=[[*PROMPT, yes]])) == {EOS}
    # Recomputed from scratch (no cached prefix): the generated tokens arrive as inputs.
    assert allowed(grammars, batch([(3, 0, [*PROMPT, yes], s)])) == {bang}


def test_a_rejected_token_leaves_only_eos(
    grammars: ReqPoolGrammars, compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    s = sampler(compiler, Grammar(kind="regex", spec="(yes|no)!"))
    assert allowed(grammars, batch([(0, 0, [*PROMPT, token(tokenizer, "maybe")], s)])) == {EOS}


def test_free_rows_keep_their_logits_and_a_free_batch_its_tensor(
    grammars: ReqPoolGrammars, compiler: GrammarCompiler
) -> None:
    json_sampler = sampler(compiler, Grammar(kind="json_object"))
    free = batch([(0, 0, PROMPT, sampler(compiler, None))])
    grammars.update(free, torch.tensor(free.input_ids))
    logits = torch.randn(1, VOCAB)
    assert grammars.apply(logits, [0]) is logits, "no grammar row: the logits go through untouched"
    mixed = batch([(0, 3, [9], None), (1, 0, PROMPT, json_sampler)])
    grammars.update(mixed, torch.tensor(mixed.input_ids))
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    grammars.apply(logits, mixed.req_pool_idx)
    assert torch.equal(logits[0], before[0])
    finite = torch.isfinite(logits[1])
    assert 0 < int(finite.sum()) < VOCAB and torch.equal(logits[1][finite], before[1][finite])


def test_json_allows_no_free_whitespace(
    grammars: ReqPoolGrammars, compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    s = sampler(compiler, Grammar(kind="json_object"))
    opened = allowed(grammars, batch([(0, 0, [*PROMPT, token(tokenizer, "{")], s)]))
    texts = {str(tokenizer.decode([t])) for t in opened}
    assert texts and all(not t[:1].isspace() for t in texts), sorted(texts)[:20]
    assert '"' in texts and "}" in texts


def test_a_req_pool_idx_given_to_a_free_request_drops_its_matcher(
    grammars: ReqPoolGrammars, compiler: GrammarCompiler
) -> None:
    allowed(grammars, batch([(0, 0, PROMPT, sampler(compiler, Grammar(kind="json_object")))]))
    assert len(allowed(grammars, batch([(0, 0, PROMPT, sampler(compiler, None))]))) == VOCAB


def test_a_grammar_the_worker_cannot_load_fails_the_batch_not_the_worker(
    grammars: ReqPoolGrammars, compiler: GrammarCompiler
) -> None:
    good = sampler(compiler, Grammar(kind="regex", spec="x"))
    assert good.grammar is not None
    broken = msgspec.structs.replace(
        good, grammar=msgspec.structs.replace(good.grammar, key="corrupt", compiled='{"not": "a grammar"}')
    )
    with pytest.raises(GrammarError, match="cannot be loaded"):
        allowed(grammars, batch([(0, 0, PROMPT, broken)]))
    assert allowed(grammars, batch([(0, 0, PROMPT, good)])) == {token_of_x(compiler)}


def token_of_x(compiler: GrammarCompiler) -> int:
    ids = compiler._tokenizer.encode("x")
    assert len(ids) == 1
    return int(ids[0])


def test_strict_schemas_allow_no_unlisted_property(
    grammars: ReqPoolGrammars, compiler: GrammarCompiler
) -> None:
    import xgrammar

    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    for strict, extra_allowed in ((True, False), (False, True)):
        spec = compiler.compile_blocking(Grammar(kind="json_schema", spec=schema, strict=strict))
        compiled = grammars.compiled.get(spec.for_request([EOS], 0))
        matcher = xgrammar.GrammarMatcher(compiled)
        assert matcher.accept_string('{"a": 1, "b": 2}') == extra_allowed
