"""The results half of the Scheduler: what the worker's results do to requests (tokens in,
requests finished, KV freed, forks started), and the bookkeeping of ending a request.

A mixin of ``Scheduler`` (scheduler.py), which owns the state declared here.
"""

from __future__ import annotations

import logging
from collections import deque

from protocol.logprobs import TopTokens
from protocol.messages import FinishReason, ForwardResult
from scheduler_proc.batch import Row, RowResult, plain_logprobs, row_results
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.kv_manager import KVManager
from scheduler_proc.outputs import OutputCollector
from scheduler_proc.request import Req, ReqStatus
from scheduler_proc.speculative import acceptance_floor


class ResultHandling:
    """Applies ForwardResults to the scheduler's requests (the state is the Scheduler's)."""

    config: SchedulerConfig
    kv: KVManager
    waiting: deque[Req]
    chunked_req: Req | None
    running: list[Req]
    reqs: dict[int, Req]
    num_generated_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_verify_rows: int
    last_batch_rows: int  # decode rows of the last batch with any (sets when drafting pays)
    _in_flight: dict[int, list[Row]]
    _outputs: OutputCollector
    _log: logging.Logger

    # ------------------------------------------------------------------ results

    def on_result(self, result: ForwardResult) -> None:
        """Append sampled tokens, finish requests, free their KV, record output rows."""
        rows = self._in_flight.pop(result.step, None)
        if rows is None:
            self._log.warning("dropped a result for unknown step %d", result.step)
            return
        logprobs = plain_logprobs(rows, result)
        if logprobs is not None:  # one token a plain row: no RowResult made (a decode step)
            for row, token, logprob in zip(rows, result.token_ids, logprobs, strict=True):
                self._apply_token_row(row, token, logprob)
            return
        results = row_results(rows, result)
        if isinstance(results, str):
            self._fail_rows(result.step, rows, results)
            return
        for row, row_result in zip(rows, results, strict=True):
            self._apply_row(row, row_result)

    def _apply_row(self, row: Row, result: RowResult) -> None:
        req, token = row.req, result.token
        if req.status is ReqStatus.FINISHED:  # ended while in flight: its token is dropped
            req.flight.drop(row)
            if not req.flight.rows:
                self.kv.release(req, cache=req.finish_reason is not FinishReason.ERROR)
            return
        if row.draft:
            self._apply_verify_row(row, result)
            return
        req.flight.land(row, token)
        if row.is_prefill:  # its prompt pages are shareable from the next round on
            self.kv.cache_unfinished(req)
        if row.forks:  # the prompt's last row: the choices forking from it start
            for fork, fork_result in zip(row.forks, result.forks, strict=True):
                self._start_fork(fork, req, fork_result)
            req.forks = []
        if req.prompt_logprobs is not None:
            self._outputs.add_prompt_logprobs(req.rid, req.prompt_logprobs, row.start, result)
        if req.embedding is not None and result.pooled is not None:
            req.embedding.add(row.start, row.extend_len, result.pooled)
            complete = req.embedding.take(req.rid)
            if complete is not None:
                self._outputs.add_embedding(complete)
        if token is None:
            if req.max_new_tokens == 0 and req.computed_len == req.seq_len:  # prompt-only: done
                self.running.remove(req)
                self._finish(req, FinishReason.LENGTH)
                self._outputs.add_abort(req.rid, FinishReason.LENGTH, req.cached_tokens)
            return
        self._add_token(req, row, token, result.logprob, result.top)

    def _apply_token_row(self, row: Row, token: int, logprob: float) -> None:
        """``_apply_row`` for a plain sampling row's token (batch.plain_logprobs), without a
        RowResult: what ``_apply_row`` does for such a row of a live request that wants no prompt
        logprobs or embedding; any other goes through it."""
        req = row.req
        if req.status is ReqStatus.FINISHED or req.prompt_logprobs is not None or req.embedding is not None:
            self._apply_row(row, RowResult(token, logprob))
            return
        req.flight.land(row, token)
        if row.is_prefill:  # its prompt pages are shareable from the next round on
            self.kv.cache_unfinished(req)
        self._add_token(req, row, token, logprob, None)

    def _add_token(self, req: Req, row: Row, token: int, logprob: float, top: TopTokens | None) -> None:
        """A sampling row's landed token into the step's output; the request ends if it should."""
        self.num_generated_tokens += 1
        reason = req.finish_reason_at(row.out_index, self.config.context_len)
        self._outputs.add_token(req.rid, token, logprob, reason, req.cached_tokens, top)
        if reason is not None:
            req.flight.end_at(row)
            self.running.remove(req)
            self._finish(req, reason)

    def _apply_verify_row(self, row: Row, result: RowResult) -> None:
        """A verify row's tokens (its taken drafts, then its draw) up to the first that ends the
        request; the KV of the drafts not taken is given back (pages past the request's KV freed)."""
        req, drawn = row.req, [result, *result.more]
        assert req.draft is not None, f"rid {req.rid}: a verify row of a request that does not draft"
        skips = self.config.overlap_schedule and self.last_batch_rows > 1  # decode_rows._decoders
        floor = acceptance_floor(
            self.last_batch_rows, self.config.speculative_row_cost, len(row.draft), skips
        )
        req.draft.on_verified(len(row.draft), len(drawn) - 1, floor)
        self.num_draft_tokens += len(row.draft)
        self.num_accepted_tokens += len(drawn) - 1
        self.num_verify_rows += 1
        tokens = [d.token for d in drawn if d.token is not None]
        assert len(tokens) == len(drawn), f"rid {req.rid}: a verify row drew nothing"
        ctx = self.config.context_len
        reasons = [req.finish_reason_of(t, row.out_index + i, ctx) for i, t in enumerate(tokens)]
        end = next((i + 1 for i, reason in enumerate(reasons) if reason is not None), len(tokens))
        req.flight.land_verified(row, tokens[:end])
        self.kv.roll_back(req)
        for token, d, reason in zip(tokens[:end], drawn, reasons, strict=False):
            self.num_generated_tokens += 1
            self._outputs.add_token(req.rid, token, d.logprob, reason, req.cached_tokens, d.top)
        last = reasons[end - 1]
        if last is not None:
            self.running.remove(req)
            self._finish(req, last)

    def _start_fork(self, fork: Req, leader: Req, result: RowResult) -> None:
        """A choice's first token, drawn from its leader's last prompt row: it shares the leader's
        prompt KV from now on and runs (or ends) as any request."""
        if fork.status is ReqStatus.FINISHED:  # aborted while the row was out
            return
        assert result.token is not None, f"rid {fork.rid}: a fork drew no token"
        self.kv.attach_fork(fork, leader)
        fork.leader, fork.status, fork.cached_tokens = None, ReqStatus.RUNNING, leader.cached_tokens
        fork.output_ids.append(result.token)
        self.running.append(fork)
        self.num_generated_tokens += 1
        reason = fork.finish_reason_at(0, self.config.context_len)
        self._outputs.add_token(
            fork.rid, result.token, result.logprob, reason, fork.cached_tokens, result.top
        )
        if reason is not None:
            self.running.remove(fork)
            self._finish(fork, reason)

    def _end_forks(self, req: Req, reason: FinishReason, error: str | None = None) -> None:
        """``req`` ended before its prompt was computed: so do the choices forking from it."""
        for fork in req.forks:
            self._finish(fork, reason)
            if error is None:
                self._outputs.add_abort(fork.rid, reason, 0)
            else:
                self._outputs.add_error(fork.rid, error)
        req.forks = []

    def _fail_rows(self, step: int, rows: list[Row], error: str) -> None:
        self._log.error("forward step %d failed (%s): failing its %d requests", step, error, len(rows))
        for row in rows:
            req = row.req
            req.flight.drop(row)
            if req.status is ReqStatus.FINISHED:
                if not req.flight.rows:
                    self.kv.release(req, cache=False)  # a forward over it failed: trust none of its KV
                continue
            self._remove_from_queues(req)
            self._finish(req, FinishReason.ERROR)
            self._outputs.add_error(req.rid, f"forward pass failed: {error}")
            self._end_forks(req, FinishReason.ERROR, f"forward pass failed: {error}")

    # ------------------------------------------------------------------ bookkeeping

    def _remove_from_queues(self, req: Req) -> None:
        if req.status is ReqStatus.FORKING:
            assert req.leader is not None, f"rid {req.rid}: forking without a leader"
            req.leader.forks.remove(req)
        elif req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        elif req is self.chunked_req:
            self.chunked_req = None
        else:
            self.running.remove(req)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        del self.reqs[req.rid]
        if not req.flight.rows:
            self.kv.release(req, cache=reason is not FinishReason.ERROR)
