"""Every rule of a ForwardBatch from the scheduler (docs/architecture.md, "ForwardBatch's alignment
rules"), checked in one place before the forward touches anything.

A number that breaks a rule would otherwise reach an index op, where a CUDA index fault kills the
process, or give a wrong answer quietly (a pooling row over drafted positions). ``check_batch`` runs
the rules in order, and the order is the invariant that lets each be short: the row and flat-list
lengths first, so every rule after them may index any list it reads. A broken rule raises
``BatchError`` naming the step and what is wrong; the worker answers it as a failed batch
(``ForwardResult.error``) and keeps serving.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass
from itertools import accumulate

from protocol.logprobs import MAX_TOP_LOGPROBS
from protocol.messages import PENDING, ForwardBatch
from protocol.sampling import WorkerSampling


class BatchError(ValueError):
    """A ForwardBatch breaks one of its rules; nothing of it has run."""


@dataclass(frozen=True)
class BatchLimits:
    """What the rules read of the worker, fixed once the model and its KV pool are built."""

    max_requests: int  # rows of the page table: req_pool_idx is in [0, max_requests)
    pages_per_request: int  # columns of the page table
    num_pages: int  # pages in the KV pool
    context_len: int
    vocab_size: int
    why_no_pooling: str | None  # why the model cannot pool its hidden states (None: it can)


def check_batch(batch: ForwardBatch, limits: BatchLimits, has_sampler: Sequence[bool]) -> None:
    """Raise BatchError at the first rule ``batch`` breaks. ``has_sampler[idx]``: the worker holds
    sampler settings for req_pool_idx ``idx`` from an earlier batch."""
    for rule in _RULES:
        rule(batch, limits)
    _sampling_rows_have_samplers(batch, has_sampler)


def _fail(batch: ForwardBatch, why: str) -> BatchError:
    return BatchError(f"batch {batch.step}: {why}")


def _lengths(batch: ForwardBatch, limits: BatchLimits) -> None:
    rows = len(batch.req_pool_idx)
    per_row = (batch.prefix_lens, batch.extend_lens, batch.page_starts, batch.page_counts)
    if rows == 0 or any(len(f) != rows for f in (*per_row, batch.sample, batch.sampler)):
        raise _fail(batch, f"row fields must all have {rows} > 0 entries")
    optional: dict[str, Sized] = {
        "prefix_ids": batch.prefix_ids,
        "prompt_logprob_lens": batch.prompt_logprob_lens,
        "pool": batch.pool,
        "draft_lens": batch.draft_lens,
        "rope_offsets": batch.rope_offsets,
    }
    for name, values in optional.items():
        if values and len(values) != rows:
            raise _fail(batch, f"{name} has {len(values)} entries for {rows} rows (one per row, or none)")
    if len(batch.input_ids) != sum(batch.extend_lens) or len(batch.pages) != sum(batch.page_counts):
        raise _fail(batch, "input_ids / pages do not match extend_lens / page_counts")
    if batch.prompt_logprob_targets and not batch.prompt_logprob_lens:
        raise _fail(batch, "prompt_logprob_targets without prompt_logprob_lens")
    if len(batch.prompt_logprob_targets) != sum(batch.prompt_logprob_lens):
        raise _fail(batch, "prompt_logprob_targets must hold sum(prompt_logprob_lens) ids")
    forks = len(batch.fork_rows)
    if len(batch.fork_req_pool_idx) != forks or len(batch.fork_samplers) != forks:
        raise _fail(batch, f"fork fields must all have {forks} entries")
    if len(batch.copy_dst) != len(batch.copy_src):
        raise _fail(batch, "copy_src and copy_dst must pair up")
    if len(batch.image_rows) != len(batch.images) or len(batch.state_load_ids) != len(batch.state_load_rows):
        raise _fail(batch, "image_rows / state_load_ids must pair up with images / state_load_rows")
    if not len(batch.state_save_rows) == len(batch.state_save_lens) == len(batch.state_save_ids):
        raise _fail(batch, "state_save_rows, state_save_lens and state_save_ids must pair up")


def _row_references(batch: ForwardBatch, limits: BatchLimits) -> None:
    """Images and state checkpoints name rows of this batch; a checkpoint is saved within its row.
    (The checkpoint ids' range is the state pool's: recurrent_state.check_checkpoints.)"""
    if not (batch.image_rows or batch.state_load_rows or batch.state_save_rows):
        return  # (the common batch: each rule on optional fields returns at once when they are empty)
    rows = len(batch.req_pool_idx)
    named = [*batch.image_rows, *batch.state_load_rows, *batch.state_save_rows]
    if any(not 0 <= r < rows for r in named):
        raise _fail(batch, f"image_rows / state_*_rows must be rows of the batch, in [0, {rows})")
    lens = zip(batch.state_save_rows, batch.state_save_lens, strict=True)
    if any(not 1 <= n <= batch.extend_lens[r] for r, n in lens):
        raise _fail(batch, "state_save_lens must be in [1, the row's extend_len]")


def _req_pool_idx(batch: ForwardBatch, limits: BatchLimits) -> None:
    n = limits.max_requests
    if len(set(batch.req_pool_idx)) != len(batch.req_pool_idx) or not all(
        0 <= i < n for i in batch.req_pool_idx
    ):
        raise _fail(batch, f"req_pool_idx must be distinct and in [0, {n})")


def _positions(batch: ForwardBatch, limits: BatchLimits) -> None:
    if any(n < 1 for n in batch.extend_lens) or any(p < 0 for p in batch.prefix_lens):
        raise _fail(batch, "extend_lens must be >= 1 and prefix_lens >= 0")
    if any(p + n > limits.context_len for p, n in zip(batch.prefix_lens, batch.extend_lens, strict=True)):
        raise _fail(batch, f"a row runs past the context length {limits.context_len}")


def _page_deltas(batch: ForwardBatch, limits: BatchLimits) -> None:
    width = limits.pages_per_request
    starts, counts = batch.page_starts, batch.page_counts
    ends = (s + c for s, c in zip(starts, counts, strict=True))
    if any(s < 0 for s in starts) or any(c < 0 for c in counts) or any(e > width for e in ends):
        raise _fail(batch, f"page deltas outside [0, {width}) (page_starts and page_counts >= 0)")
    if batch.pages and not (0 <= min(batch.pages) and max(batch.pages) < limits.num_pages):
        raise _fail(batch, f"pages must be in [0, {limits.num_pages})")


def _tokens(batch: ForwardBatch, limits: BatchLimits) -> None:
    if min(batch.input_ids) < PENDING or max(batch.input_ids) >= limits.vocab_size:
        raise _fail(batch, f"token ids must be in [0, {limits.vocab_size}) or PENDING")
    if min(batch.input_ids) == PENDING:
        row_ends = set(accumulate(batch.extend_lens))
        if any(tok == PENDING and i + 1 not in row_ends for i, tok in enumerate(batch.input_ids)):
            raise _fail(batch, "PENDING may only be a row's last token")


def _prefix_ids(batch: ForwardBatch, limits: BatchLimits) -> None:
    """A row that (re)assigns a req_pool_idx whose state follows tokens (penalties, a grammar) past
    position 0 carries exactly its prefix_len ids; every other row carries none."""
    if not batch.prefix_ids:
        needs = [i for i, s in enumerate(batch.sampler) if _follows_tokens(s) and batch.prefix_lens[i] > 0]
        if needs:
            raise _fail(batch, f"rows {needs} give a request penalties or a grammar but lack prefix_ids")
        return
    for i, ids in enumerate(batch.prefix_ids):
        expected = batch.prefix_lens[i] if _follows_tokens(batch.sampler[i]) else 0
        if len(ids) != expected:
            raise _fail(batch, f"row {i} has {len(ids)} prefix_ids, expected {expected}")
        if ids and not (0 <= min(ids) and max(ids) < limits.vocab_size):
            raise _fail(batch, f"prefix_ids must be in [0, {limits.vocab_size})")


def _follows_tokens(sampler: WorkerSampling | None) -> bool:
    return sampler is not None and sampler.needs_prefix_ids


def _samplers(batch: ForwardBatch, limits: BatchLimits) -> None:
    """The settings of the rows and forks: top-N within its bound and with logprobs; every token id
    one names (logit bias, min_tokens' stop ids, a grammar's stop ids) in the vocabulary."""
    vocab = limits.vocab_size
    for p in (*(s for s in batch.sampler if s is not None), *batch.fork_samplers):
        if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS or (p.top_logprobs and not p.logprobs):
            raise _fail(batch, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], with logprobs")
        named: list[int] = list(p.grammar.stop_token_ids) if p.grammar is not None else []
        if p.penalties is not None:
            if len(p.penalties.bias_ids) != len(p.penalties.bias_values):
                raise _fail(batch, "a sampler's bias_ids and bias_values must pair up")
            named += p.penalties.bias_ids + p.penalties.min_tokens_ids
        if named and not (0 <= min(named) and max(named) < vocab):
            raise _fail(batch, f"a sampler's bias, min_tokens and grammar stop ids must be in [0, {vocab})")


def _prompt_logprobs(batch: ForwardBatch, limits: BatchLimits) -> None:
    lens = batch.prompt_logprob_lens
    if not lens and not batch.prompt_logprob_targets:
        return
    if any(not 0 <= n <= e for n, e in zip(lens, batch.extend_lens, strict=False)):
        raise _fail(batch, "prompt_logprob_lens must be in [0, extend_lens]")
    if any(not 0 <= t < limits.vocab_size for t in batch.prompt_logprob_targets):
        raise _fail(batch, f"prompt_logprob_targets must be in [0, {limits.vocab_size})")


def _forks(batch: ForwardBatch, limits: BatchLimits) -> None:
    if not batch.fork_rows and not batch.fork_req_pool_idx:
        return
    rows = len(batch.req_pool_idx)
    if not all(0 <= i < rows and batch.sample[i] for i in batch.fork_rows):
        raise _fail(batch, "a fork's row must be a sampling row of the batch")
    n, taken, forks = limits.max_requests, set(batch.req_pool_idx), batch.fork_req_pool_idx
    if len(set(forks)) != len(forks) or any(not 0 <= s < n or s in taken for s in forks):
        raise _fail(batch, f"fork_req_pool_idx must be distinct, in [0, {n}) and rowless")


def _page_copies(batch: ForwardBatch, limits: BatchLimits) -> None:
    src, dst = batch.copy_src, batch.copy_dst
    if not src and not dst:
        return
    if len(set(dst)) != len(dst):
        raise _fail(batch, "a page is copied into twice (each copy_dst once)")
    if set(src) & set(dst):
        raise _fail(batch, "a page is both copied and copied into")
    if not all(0 <= p < limits.num_pages for p in (*src, *dst)):
        raise _fail(batch, f"copied pages must be in [0, {limits.num_pages})")


def _drafts(batch: ForwardBatch, limits: BatchLimits) -> None:
    """Per row, 0 <= draft_len < extend_len; a verify row samples, has no PENDING input (its
    request waited for its last token) and no forks."""
    if not batch.draft_lens:
        return
    ends = list(accumulate(batch.extend_lens))
    for i, d in enumerate(batch.draft_lens):
        if not 0 <= d < batch.extend_lens[i]:
            raise _fail(batch, f"row {i} drafts {d} of {batch.extend_lens[i]} tokens")
        if d and not batch.sample[i]:
            raise _fail(batch, f"row {i} drafts but does not sample")
        if d and PENDING in batch.input_ids[ends[i] - batch.extend_lens[i] : ends[i]]:
            raise _fail(batch, f"verify row {i} has a PENDING input")
        if d and i in batch.fork_rows:
            raise _fail(batch, f"verify row {i} has forks")


def _pool(batch: ForwardBatch, limits: BatchLimits) -> None:
    """A pooling row pools prompt positions only (a draft's are void), of a model that can pool."""
    if not batch.pool:
        return
    pooling = [i for i, kind in enumerate(batch.pool) if kind is not None]
    if pooling and limits.why_no_pooling is not None:
        raise _fail(batch, f"rows {pooling} pool, but the model cannot: {limits.why_no_pooling}")
    drafted = [i for i in pooling if batch.draft_lens and batch.draft_lens[i]]
    if drafted:
        raise _fail(batch, f"pooling rows {drafted} have drafts")


# In this order: _lengths first, so that every rule after it may index what it reads.
_RULES: tuple[Callable[[ForwardBatch, BatchLimits], None], ...] = (
    _lengths,
    _req_pool_idx,
    _row_references,
    _positions,
    _page_deltas,
    _tokens,
    _prefix_ids,
    _samplers,
    _prompt_logprobs,
    _forks,
    _page_copies,
    _drafts,
    _pool,
)


def _sampling_rows_have_samplers(batch: ForwardBatch, has_sampler: Sequence[bool]) -> None:
    """A sampling row draws with its request's settings: sent in this batch, or with an earlier row
    that (re)assigned its req_pool_idx."""
    missing = [
        idx
        for idx, sample, sampler in zip(batch.req_pool_idx, batch.sample, batch.sampler, strict=True)
        if sample and sampler is None and not has_sampler[idx]
    ]
    if missing:
        raise _fail(batch, f"req_pool_idx {missing} sample without sampler settings (none sent yet)")
