"""Constrained decoding in the worker: one xgrammar matcher per request (by req_pool_idx), and a token
mask on the sampled rows whose request has a grammar.

Where the state lives, and why here: under overlap scheduling the scheduler sends a decode row
whose input is PENDING (the token its request drew last) before it has seen that token; only the
worker knows token t when it builds the mask for t + 1. A matcher in the scheduler would force
grammar rows out of overlap, so the matcher lives here, next to the per-request penalty state.

Like the penalty counts (penalties.py) a matcher follows the tokens the worker *runs*, never what
it draws: a row's inputs are its positions [prefix_len, prefix_len + extend_len), and those from
the request's ``prompt_len`` on are generated tokens, fed to the matcher in order before the row's
mask is built. So:

- a decode row's input is the token drawn last (PENDING resolved), and the matcher has accepted
  every emitted token when it masks the next one;
- a req_pool_idx given to a request (a new one, or a retracted one sent again) starts a fresh matcher,
  which follows the generated part of the cached prefix (``ForwardBatch.prefix_ids``) and then the
  recompute's inputs: a retracted request's matcher is rebuilt from its output tokens;
- the void row scheduled after a request's last token (overlap) feeds that token, EOS for a
  grammar that ended, to a matcher that then has terminated: such a row, or one whose matcher
  rejected a token (a grammar that min_tokens or logit_bias fought), gets a mask that allows only
  its stop tokens, so the request ends; the void row's token is dropped by the scheduler anyway.

Jump-forward decoding (emitting the tokens a grammar forces without a forward) is left out: it
changes a request's token count in a way the scheduler, which sent PENDING rows ahead, cannot know.

A batch with no grammar row costs one list scan (``apply`` returns the logits untouched).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from protocol.messages import ForwardBatch
from protocol.sampling import WorkerGrammar, WorkerSampling

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

COMPILED_CACHE_ENTRIES = 128  # deserialized grammars kept by key (a JSON schema's is ~50-200 KB)
BITS = 32  # tokens per word of xgrammar's bitmask (int32)
XGRAMMAR_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # its CPU masking kernel's


class GrammarError(ValueError):
    """A grammar the worker cannot use (it fails the batch's requests, not the worker)."""


class CompiledGrammars:
    """The model's xgrammar TokenizerInfo, built on first use (once, slow: it reads every token of
    the tokenizer at ``model_path``), and the deserialized grammars by key, least recently used
    dropped first."""

    def __init__(self, model_path: str, vocab_size: int, entries: int = COMPILED_CACHE_ENTRIES) -> None:
        self._model_path = model_path
        self._vocab_size = vocab_size
        self._entries = entries
        self._tokenizer_info: xgrammar.TokenizerInfo | None = None
        self._compiled: OrderedDict[str, xgrammar.CompiledGrammar] = OrderedDict()

    def tokenizer_info(self) -> xgrammar.TokenizerInfo:
        if self._tokenizer_info is None:
            import xgrammar
            from transformers import AutoTokenizer

            started = time.perf_counter()
            tokenizer = AutoTokenizer.from_pretrained(self._model_path)
            # As tokenizer_proc/grammar.py builds it: a compiled grammar checks these metadata.
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self._vocab_size)
            self._tokenizer_info = info
            logger.info("grammar vocabulary read in %.2f s (once)", time.perf_counter() - started)
        return self._tokenizer_info

    def get(self, grammar: WorkerGrammar) -> xgrammar.CompiledGrammar:
        compiled = self._compiled.get(grammar.key)
        if compiled is not None:
            self._compiled.move_to_end(grammar.key)
            return compiled
        import xgrammar

        try:
            compiled = xgrammar.CompiledGrammar.deserialize_json(grammar.compiled, self.tokenizer_info())
        except Exception as exc:  # xgrammar raises its own errors and RuntimeError
            raise GrammarError(f"grammar {grammar.key[:12]} cannot be loaded: {exc}") from exc
        self._compiled[grammar.key] = compiled
        if len(self._compiled) > self._entries:
            self._compiled.popitem(last=False)
        return compiled


@dataclass
class _Matcher:
    """One request's matcher; ``stop_only`` once it terminated or rejected a token."""

    matcher: xgrammar.GrammarMatcher
    prompt_len: int
    stop_token_ids: list[int]
    key: str  # the grammar's, for the log
    stop_only: bool = False
    followed: int = field(default=0)  # generated tokens accepted so far

    def follow(self, tokens: list[int]) -> None:
        for token in tokens:
            if self.stop_only:
                return
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                if not self.matcher.is_terminated():
                    logger.warning(
                        "grammar %s rejected token %d after %d tokens; the request is ended",
                        self.key[:12], token, self.followed,
                    )  # fmt: skip
                self.stop_only = True
                return
            self.followed += 1
            self.stop_only = self.matcher.is_terminated()


class ReqPoolGrammars:
    """Which requests have a grammar (a matcher per req_pool_idx, None for most) and the two steps of a batch:
    ``update`` from its samplers and input tokens, then ``apply`` to its sampled rows' logits."""

    def __init__(self, max_requests: int, vocab_size: int, model_path: str, host_memory: bool = True) -> None:
        self.vocab_size = vocab_size
        self.host_memory = host_memory  # the logits live in host memory (the backend says)
        self.compiled = CompiledGrammars(model_path, vocab_size)
        self.matchers: list[_Matcher | None] = [None] * max_requests
        self._batch_matcher: xgrammar.BatchGrammarMatcher | None = None  # fills rows' masks in threads

    def on_batch(self, batch: ForwardBatch, input_ids: torch.Tensor) -> None:
        """ReqPoolState: the batch's tokens, then its forks."""
        self.update(batch, input_ids)
        if batch.fork_rows:
            self.fork(batch.fork_req_pool_idx, batch.fork_samplers)

    def on_drafts_taken(self, req_pool_idx: list[int], positions: list[int], tokens: list[int]) -> None:
        """ReqPoolState: a kept draft (always a generated token) is followed as an input is."""
        for idx, token in zip(req_pool_idx, tokens, strict=True):
            state = self.matchers[idx]
            if state is not None:
                state.follow([token])

    def update(self, batch: ForwardBatch, input_ids: torch.Tensor) -> None:
        """Take the batch's new samplers (a req_pool_idx given to a request starts a fresh matcher that
        follows its cached prefix), then feed each grammar row's generated input tokens
        (``input_ids``: the batch's tokens with PENDING resolved)."""
        for i, (idx, sampler) in enumerate(zip(batch.req_pool_idx, batch.sampler, strict=True)):
            if sampler is None:
                continue
            self.matchers[idx] = None
            if sampler.grammar is not None:
                started = self._start(sampler.grammar)
                self.matchers[idx] = started
                if batch.prefix_ids and batch.prefix_ids[i]:
                    started.follow(batch.prefix_ids[i][started.prompt_len :])
        rows = [i for i, idx in enumerate(batch.req_pool_idx) if self.matchers[idx] is not None]
        if not rows:
            return
        starts = list(accumulate(batch.extend_lens, initial=0))
        spans: list[tuple[int, int]] = []
        for i in rows:
            state = self.matchers[batch.req_pool_idx[i]]
            assert state is not None, "rows holds grammar rows only"
            skip = max(0, state.prompt_len - batch.prefix_lens[i])  # prompt tokens of this row
            spans.append((starts[i] + min(skip, batch.extend_lens[i]), starts[i + 1]))
        flat = [k for begin, end in spans for k in range(begin, end)]
        if not flat:
            return
        tokens = input_ids.index_select(0, torch.tensor(flat, device=input_ids.device)).tolist()
        offset = 0
        for i, (begin, end) in zip(rows, spans, strict=True):
            state = self.matchers[batch.req_pool_idx[i]]
            assert state is not None, "rows holds grammar rows only"
            state.follow(tokens[offset : offset + end - begin])
            offset += end - begin

    def fork(self, req_pool_idx: list[int], samplers: list[WorkerSampling]) -> None:
        """Forks (n > 1) start their own matchers: a fork's first token is drawn where its parent's
        prompt ends, before the parent's matcher has followed any generated token."""
        for idx, sampler in zip(req_pool_idx, samplers, strict=True):
            self.matchers[idx] = self._start(sampler.grammar) if sampler.grammar is not None else None

    def _start(self, grammar: WorkerGrammar) -> _Matcher:
        import xgrammar

        compiled = self.compiled.get(grammar)
        matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=grammar.stop_token_ids)
        return _Matcher(matcher, grammar.prompt_len, list(grammar.stop_token_ids), grammar.key)

    def apply(self, logits: torch.Tensor, req_pool_idx: list[int]) -> torch.Tensor:
        """``logits`` [rows, vocab] of the sampled rows at ``req_pool_idx``, with -inf, in place, on every
        token a grammar row's matcher does not allow next; untouched when no row has a grammar."""
        rows = [r for r, idx in enumerate(req_pool_idx) if self.matchers[idx] is not None]
        if not rows:
            return logits
        import xgrammar

        width = logits.shape[-1]
        bitmask = self._bitmask(rows, req_pool_idx, width)
        if self.host_memory and logits.dtype in XGRAMMAR_CPU_DTYPES:
            # xgrammar's C++ loop, far faster than unpacking the bits in torch
            # (docs/benchmarks-history.md).
            xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=rows)
            return logits
        # Elsewhere (CUDA, float64): unpack the bits on the logits' device, 32x less to copy there.
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        words = bitmask.index_select(0, index.cpu()).to(logits.device)
        shifts = torch.arange(BITS, dtype=torch.int32, device=logits.device)
        allowed = ((words[:, :, None] >> shifts) & 1).view(len(rows), -1)[:, :width].bool()
        masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
        return logits.index_copy_(0, index, masked)

    def _bitmask(self, rows: list[int], req_pool_idx: list[int], width: int) -> torch.Tensor:
        """[len(req_pool_idx), ceil(width / 32)] int32 on the CPU, xgrammar's packed mask (bit set: allowed)
        filled at the grammar ``rows`` (the other rows are never read)."""
        import xgrammar

        bitmask = torch.zeros(len(req_pool_idx), (width + BITS - 1) // BITS, dtype=torch.int32)
        live: list[xgrammar.GrammarMatcher] = []
        live_rows: list[int] = []
        for row in rows:
            state = self.matchers[req_pool_idx[row]]
            assert state is not None, "rows holds grammar rows only"
            if state.stop_only:
                for token in state.stop_token_ids:
                    bitmask[row, token // BITS] |= _bit(token % BITS)
            else:
                live.append(state.matcher)
                live_rows.append(row)
        if live:
            if self._batch_matcher is None:
                self._batch_matcher = xgrammar.BatchGrammarMatcher(max_threads="auto")
            self._batch_matcher.batch_fill_next_token_bitmask(live, bitmask, indices=live_rows)
        return bitmask


def _bit(position: int) -> int:
    """The int32 word with bit ``position`` set (bit 31 is the sign bit)."""
    return (1 << position) - (1 << 32 if position == BITS - 1 else 0)
