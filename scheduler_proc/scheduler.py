"""The scheduler's pure core: queues, admission, batches, results. No sockets, no tensors.

Every request is in exactly one place while it lives:

    waiting (deque)        -> no req_pool_idx, no pages, kv_len == 0; arrival order, retracted at the front
    chunked_req (one)      -> req_pool_idx, pages of [0, kv_len); more prompt chunks to go
    running (list)         -> req_pool_idx, pages; kv_len == seq_len - 1, or its last chunk is in flight
    a leader's forks       -> choices 1.. of an n > 1 request until its prompt is computed (FORKING)

A finished request is in none of them; its pages and req_pool_idx are freed at once,
or when the last batch still carrying it returns (``Req.flight.rows``).

Overlap (``overlap_schedule``): the next batch is built and sent while the worker
runs the current one, so the worker never waits for the scheduler. A row's
effects on the request's state (its KV length, one ``PENDING`` output token if
it samples) apply when it is sent; the result only fills in the token and
finishes the request. ``Req.flight`` (flight.py) holds that state and asserts
its invariants at every step. What cannot be known ahead costs little: a request that
draws a stop token has already been given one more decode row, whose token is
dropped. Retraction needs every token back, so it waits until nothing is in flight.

Speculative decoding (``speculative_algorithm``, speculative.py): a running request that drafts
gets a verify row (its last token and its drafts) and nothing more until that row's result is in,
since its next draft needs every token: under the overlap schedule it skips the batch built while
its row is in flight and drafts in the one after, while the other requests stay overlapped (alone,
it waits for its result).
"""

from __future__ import annotations

import logging
from collections import deque

from protocol.messages import (
    FinishReason,
    ForwardBatch,
    RequestError,
    TokenizedRequest,
    ToTokenizer,
)
from scheduler_proc.admission import Admission
from scheduler_proc.batch import BatchInfo, ImagePrefetch, Row, build_forward_batch
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.decode_rows import DecodeRows
from scheduler_proc.kv_manager import KVManager
from scheduler_proc.outputs import OutputCollector
from scheduler_proc.prefill_adder import Admitted, PrefillAdder
from scheduler_proc.request import Req, ReqStatus, fork_choices, why_rejected
from scheduler_proc.results import ResultHandling
from scheduler_proc.speculative import DraftState, DraftTotals, NgramIndex
from scheduler_proc.state_checkpoints import HybridKVManager
from scheduler_proc.token_ratio import NewTokenRatio


class Scheduler(ResultHandling, DecodeRows):
    """Admits requests into batches for the worker and turns its results into token rows.

    ``schedule()`` returns None only when a batch is in flight or there is no
    work: with nothing in flight, the waiting head always fits an empty pool
    (``add`` rejects any request that could not), so the engine cannot stall.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.max_in_flight = 2 if config.overlap_schedule else 1
        self._init_kv()
        self._init_queues()
        self._init_counters()
        # The core logs only warnings and errors; the INFO batch lines live in stats.py.
        self._log = logging.getLogger("rivulet.scheduler")

    def _init_kv(self) -> None:
        # A hybrid model's prefix cache resumes from recurrent-state checkpoints (state_checkpoints.py).
        self.kv = (HybridKVManager if self.config.state_checkpoints > 0 else KVManager)(self.config)

    def _init_queues(self) -> None:
        self.waiting: deque[Req] = deque()
        self.prefetch = ImagePrefetch()  # waiting requests' images sent ahead to the tower
        self.chunked_req: Req | None = None
        self.running: list[Req] = []
        self.reqs: dict[int, Req] = {}  # every live request by rid
        self._in_flight: dict[int, list[Row]] = {}  # step -> its rows
        self._outputs = OutputCollector()
        self.admission = Admission(self.config)
        self.new_token_ratio = NewTokenRatio(self.config)
        self._prefill_streak = 0  # batches in a row with prefill rows

    def _init_counters(self) -> None:
        self.next_step = 0
        self.last_batch: BatchInfo | None = None
        self.num_retracted = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0  # of requests at their first admission
        self.num_prefill_tokens = 0  # computed by prefill rows (prompts, recomputes), since start
        self.num_cached_prompt_tokens = 0  # of those, reused from the prefix cache
        # Speculative decoding, since start, counted as verify rows come back (a row whose request
        # ended while it was out is no verify): drafts checked, drafts kept, and the rows.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verify_rows = 0
        self.last_batch_rows = 1  # decode rows of the last batch that had some

    # ------------------------------------------------------------------ requests in and out

    def add(self, msg: TokenizedRequest) -> RequestError | None:
        """Queue a request, or reject it (keeping no state) when it could never run."""
        duplicate = any(msg.rid + i in self.reqs for i in range(max(msg.n, 1)))
        why = why_rejected(msg, self.config, duplicate=duplicate)
        if why is not None:
            return RequestError(rid=msg.rid, message=why)
        req = Req.from_msg(msg)
        share = self.config.prefix_cache
        cfg = self.config
        for r in [req, *fork_choices(req, msg.n, cfg.page_size, share_prompt=share)]:
            self.reqs[r.rid] = r
            if cfg.speculative and r.max_new_tokens > 1:
                index = NgramIndex(cfg.speculative_ngram_min_size, cfg.speculative_ngram_max_size)
                r.draft = DraftState(index)
        self.waiting.append(req)
        return None

    def abort(self, rid: int, reason: FinishReason) -> None:
        """End ``rid`` wherever it is; unknown rids are ignored (it may have just finished)."""
        req = self.reqs.get(rid)
        if req is None:
            return
        self._remove_from_queues(req)
        self._finish(req, reason)
        self._outputs.add_abort(rid, reason, req.cached_tokens)
        self._end_forks(req, reason)

    def take_outputs(self) -> list[ToTokenizer]:
        """The pending TokenBatch (all rows of the step) and RequestErrors; [] when none."""
        return self._outputs.take()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.chunked_req is not None or self.running)

    @property
    def batch_in_flight(self) -> bool:
        return bool(self._in_flight)

    def in_flight_reqs(self) -> list[Req]:
        """Requests of the batches the worker holds, aborted ones included (they still own KV)."""
        return list(dict.fromkeys(row.req for rows in self._in_flight.values() for row in rows))

    def flush_cache(self) -> int:
        """Evict every cached prefix no live request holds; returns the pages freed."""
        return self.kv.flush_cache()

    def fail_in_flight(self, error: str) -> None:
        """Fail every batch in flight, e.g. when the worker's reply could not be decoded."""
        for step in list(self._in_flight):
            self._fail_rows(step, self._in_flight.pop(step), error)

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> ForwardBatch | None:
        """The next batch, or None when enough are in flight or nothing can run yet."""
        if len(self._in_flight) >= self.max_in_flight:
            return None
        if not self.has_work:
            if not self._in_flight:
                self.new_token_ratio.on_idle()
            return None
        if self._in_flight and self._decode_needs_retraction():
            return None  # retraction needs every token back: wait for the batch in flight
        prefill, decode = self._next_rows()
        if not prefill and not decode:
            return None
        self._prefill_streak = self._prefill_streak + 1 if prefill else 0
        rows = prefill + decode
        step = self.next_step
        self.next_step += 1
        self.num_prefill_tokens += sum(row.extend_len for row in prefill)
        num_decoding = len(self.running) - sum(row.sample for row in prefill)
        self.last_batch = BatchInfo.of(step, prefill, decode, num_decoding)
        prefetch = self.prefetch.pick(prefill, self.waiting)
        batch = build_forward_batch(step, rows, self.config.page_size, prefetch)
        if isinstance(self.kv, HybridKVManager):
            batch = self.kv.plan(batch, rows)
        for row in rows:
            row.req.flight.launch(row, self.config.context_len)
        self._in_flight[step] = rows
        return batch

    def _next_rows(self) -> tuple[list[Row], list[Row]]:
        """(prefill rows, decode rows) of the next batch.

        Mixed: every running decode rides along with the round's prefill. Else
        prefill goes first, but at most ``max_consecutive_prefills`` batches in a
        row while running requests wait, so a stream of prompts cannot starve
        decode. ``decode_first``: a decode-only batch precedes every batch that
        admits prefill while requests are running (mixed or not).
        """
        if self.running and self._decode_due():
            decode = self._decode_rows()
            if decode:
                return [], decode
        if self.config.enable_mixed_chunk:
            decode = self._decode_rows()  # first: decode pages count before admission
            return self._prefill_rows(sum(len(row.draft) for row in decode)), decode
        prefill = self._prefill_rows()
        if prefill:
            return prefill, []
        decode = self._decode_rows()
        if decode or not self.has_work:
            return [], decode
        # Retraction emptied the running set; the pages it freed let a prefill run.
        return self._prefill_rows(), []

    def _decode_due(self) -> bool:
        cfg = self.config
        if cfg.decode_first:
            return self._prefill_streak >= 1
        return not cfg.enable_mixed_chunk and self._prefill_streak >= cfg.max_consecutive_prefills

    def _prefill_rows(self, draft_tokens: int = 0) -> list[Row]:
        """The round's prefill rows; ``draft_tokens`` (the round's verify rows') count against its
        input budget."""
        if self.chunked_req is None and not self.waiting:
            return []
        # In mixed mode the decodes' pages for this step are already taken: _decode_rows ran first.
        adder = PrefillAdder.for_round(
            self.config,
            self.running,
            self.new_token_ratio.value,
            self.kv.available_pages,
            self.kv.req_pool.num_free,
            draft_tokens,
        )
        admitted = []
        continued = self.chunked_req
        if continued is not None:
            extend_len = adder.add_chunked_req(continued)
            self.chunked_req = continued if adder.chunked_in_progress else None
            if extend_len:
                admitted.append(Admitted(continued, extend_len))
        admitted += self.admission.admit(adder, self.waiting, self.kv, continued)
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None, "at most one chunked_req at a time"
            self.chunked_req = adder.new_chunked_req
        assert len(admitted) == len(adder.can_run_list), (
            "the adder admitted a request admission did not offer"
        )
        return [self._prefill_row(req, extend_len) for req, extend_len in admitted]

    def _prefill_row(self, req: Req, extend_len: int) -> Row:
        new_req_pool_idx = req.req_pool_idx is None
        if req.status is ReqStatus.WAITING:
            self.kv.assign_req_pool_idx(req)
            self.kv.admit_forks(req)
            if req.num_retractions == 0:  # a recompute after retraction is no cache hit for the client
                req.cached_tokens = min(req.kv_len, len(req.input_ids))
                self.num_prompt_tokens += len(req.input_ids)
                self.num_cached_prompt_tokens += req.cached_tokens
        row = self._extend_row(req, extend_len, new_req_pool_idx, is_prefill=True)
        if row.start + extend_len == req.seq_len:  # its prompt's end: it decodes next, or ends (max 0)
            row.forks = list(req.forks)  # their first tokens come from this row's logits
            req.status = ReqStatus.RUNNING
            self.running.append(req)
        else:
            assert req is self.chunked_req, f"rid {req.rid}: only the chunked_req stops short of its end"
            req.status = ReqStatus.CHUNKED
        return row

    @property
    def draft_totals(self) -> DraftTotals:
        """Speculative decoding's counts since start (for the logs and EngineStats)."""
        return DraftTotals(self.num_draft_tokens, self.num_accepted_tokens, self.num_verify_rows)

    @property
    def cache_hit_rate(self) -> float:
        """Share of admitted prompt tokens that came from the prefix cache, since start (for logs)."""
        return self.num_cached_prompt_tokens / max(self.num_prompt_tokens, 1)
