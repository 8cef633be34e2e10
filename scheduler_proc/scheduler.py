"""The scheduler's pure core: queues, admission, batches, results. No sockets, no tensors.

Every request is in exactly one place while it lives:

    waiting (deque, FCFS)  -> no slot, no pages, kv_len == 0
    chunked_req (one)      -> slot, pages of [0, kv_len); more prompt chunks to go
    running (list)         -> slot, pages; kv_len == seq_len - 1, or its last chunk is in flight

A finished request is in none of them; its pages and slot are freed at once,
or when the batch still carrying it returns (``Req.in_flight``).
"""

from __future__ import annotations

import logging
from collections import deque

from protocol.messages import (
    FinishReason,
    ForwardBatch,
    ForwardResult,
    RequestError,
    TokenizedRequest,
    ToTokenizer,
)
from scheduler_proc.batch import BatchInfo, Row, build_forward_batch
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.outputs import OutputCollector
from scheduler_proc.page_allocator import PageAllocator, SlotPool, pages_for
from scheduler_proc.prefill_adder import AddResult, PrefillAdder, running_reservation_tokens
from scheduler_proc.request import Req, ReqStatus, why_rejected


class Scheduler:
    """Admits requests into batches for the worker and turns its results into token rows.

    ``schedule()`` returns None only when a batch is in flight or there is no
    work: with nothing in flight, the waiting head always fits an empty pool
    (``add`` rejects any request that could not), so the engine cannot stall.
    """

    max_in_flight = 1  # one batch at a time; overlap scheduling would raise this

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._init_kv()
        self._init_queues()
        self._init_counters()
        # The core logs only warnings and errors; the INFO batch lines live in stats.py.
        self._log = logging.getLogger("rivulet.scheduler")

    def _init_kv(self) -> None:
        self.pages = PageAllocator(self.config.num_pages)
        self.slots = SlotPool(self.config.max_running_requests)

    def _init_queues(self) -> None:
        self.waiting: deque[Req] = deque()
        self.chunked_req: Req | None = None
        self.running: list[Req] = []
        self.reqs: dict[int, Req] = {}  # every live request by rid
        self._in_flight: dict[int, list[Row]] = {}  # step -> its rows
        self._outputs = OutputCollector()
        self._last_was_prefill = False

    def _init_counters(self) -> None:
        self.next_step = 0
        self.last_batch: BatchInfo | None = None
        self.num_retracted = 0
        self.num_finished = 0
        self.num_generated_tokens = 0

    # ------------------------------------------------------------------ requests in and out

    def add(self, msg: TokenizedRequest) -> RequestError | None:
        """Queue a request, or reject it (keeping no state) when it could never run."""
        why = why_rejected(msg, self.config, duplicate=msg.rid in self.reqs)
        if why is not None:
            return RequestError(rid=msg.rid, message=why)
        req = Req.from_msg(msg)
        self.reqs[req.rid] = req
        self.waiting.append(req)
        return None

    def abort(self, rid: int, reason: FinishReason) -> None:
        """End ``rid`` wherever it is; unknown rids are ignored (it may have just finished)."""
        req = self.reqs.get(rid)
        if req is None:
            return
        self._remove_from_queues(req)
        self._finish(req, reason)
        self._outputs.add_abort(rid, reason)

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
        return [row.req for rows in self._in_flight.values() for row in rows]

    def fail_in_flight(self, error: str) -> None:
        """Fail every batch in flight, e.g. when the worker's reply could not be decoded."""
        for step in list(self._in_flight):
            self._fail_rows(step, self._in_flight.pop(step), error)

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> ForwardBatch | None:
        """The next batch, or None when one is in flight or nothing can run."""
        if len(self._in_flight) >= self.max_in_flight:
            return None
        prefill, decode = self._next_rows()
        if not prefill and not decode:
            return None
        self._last_was_prefill = bool(prefill)
        rows = prefill + decode
        for row in rows:
            row.req.in_flight = True
        step = self.next_step
        self.next_step += 1
        self._in_flight[step] = rows
        num_decoding = len(self.running) - sum(row.sample for row in prefill)
        self.last_batch = BatchInfo.of(step, prefill, decode, num_decoding)
        return build_forward_batch(step, rows)

    def _next_rows(self) -> tuple[list[Row], list[Row]]:
        """(prefill rows, decode rows) of the next batch.

        Mixed: every running decode rides along with the round's prefill. Else
        prefill and decode alternate, so a long chunked prompt cannot starve decodes.
        """
        if self.config.enable_mixed_chunk:
            decode = self._decode_rows()  # first: decode pages count before admission
            return self._prefill_rows(), decode
        if not (self._last_was_prefill and self.running):
            prefill = self._prefill_rows()
            if prefill:
                return prefill, []
        decode = self._decode_rows()
        if decode or not self.has_work:
            return [], decode
        # Retraction emptied the running set; the pages it freed let a prefill run.
        return self._prefill_rows(), []

    def _prefill_rows(self) -> list[Row]:
        if self.chunked_req is None and not self.waiting:
            return []
        cfg = self.config
        adder = PrefillAdder(
            page_size=cfg.page_size,
            clip_max_new_tokens=cfg.clip_max_new_tokens,
            rem_input_tokens=cfg.max_prefill_tokens,
            rem_chunk_tokens=cfg.chunk_tokens,
            # Free KV minus the running requests' reservation (in mixed mode their
            # pages for this step are already taken: _decode_rows ran first).
            rem_total_tokens=self.pages.num_free * cfg.page_size
            - running_reservation_tokens(self.running, cfg),
            free_pages=self.pages.num_free,
            free_slots=self.slots.num_free,
        )
        if self.chunked_req is not None:
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in self.waiting:
            if adder.add_one_req(req) is not AddResult.CONTINUE:
                break
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None, "at most one chunked_req at a time"
            self.chunked_req = adder.new_chunked_req
        return [self._prefill_row(req, extend_len) for req, extend_len in adder.can_run_list]

    def _prefill_row(self, req: Req, extend_len: int) -> Row:
        new_slot = req.slot is None
        if req.status is ReqStatus.WAITING:
            assert self.waiting and self.waiting[0] is req, "admission takes a prefix of the waiting queue"
            self.waiting.popleft()
            req.slot = self.slots.alloc()
            assert req.slot is not None, "the adder admitted more requests than free slots"
        row = self._extend_row(req, extend_len, new_slot)
        if row.sample:
            req.status = ReqStatus.RUNNING
            self.running.append(req)
        else:
            assert req is self.chunked_req, f"rid {req.rid}: only the chunked_req stops short of its end"
            req.status = ReqStatus.CHUNKED
        return row

    def _extend_row(self, req: Req, extend_len: int, new_slot: bool) -> Row:
        """A row extending ``req`` by ``extend_len`` tokens, with the pages they need."""
        page_start = len(req.page_table)
        num_new = max(pages_for(req.kv_len + extend_len, self.config.page_size) - page_start, 0)
        new_pages = self.pages.alloc(num_new)
        assert new_pages is not None, f"rid {req.rid}: scheduled without free pages"
        req.page_table.extend(new_pages)
        sample = req.kv_len + extend_len == req.seq_len
        return Row(req, extend_len, sample, page_start, new_pages, new_slot)

    def _decode_rows(self) -> list[Row]:
        self._make_room_for_decodes()
        rows = []
        for req in self.running:
            assert req.is_decoding, f"rid {req.rid}: running but not at a decode step"
            rows.append(self._extend_row(req, 1, new_slot=False))
        return rows

    def _make_room_for_decodes(self) -> None:
        """Retract running requests until every decode that crosses into a new page gets one."""
        while self.running:
            need = sum(1 for r in self.running if r.kv_len >= len(r.page_table) * self.config.page_size)
            if need <= self.pages.num_free:
                return
            # SGLang's order: least progress lost first; ties: the longest prompt frees most.
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
            self._retract(victim)

    def _retract(self, req: Req) -> None:
        """Give back a running request's KV; it re-prefills fill_ids later, keeping its output."""
        self.running.remove(req)
        self._release(req)
        req.kv_len = 0
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.num_retracted += 1
        self.waiting.appendleft(req)
        self._log.warning(
            "KV pool exhausted: retracted rid %d (%d output tokens kept, will recompute %d tokens); "
            "#running-req: %d, #queue-req: %d",
            req.rid,
            len(req.output_ids),
            req.seq_len,
            len(self.running),
            len(self.waiting),
        )

    # ------------------------------------------------------------------ results

    def on_result(self, result: ForwardResult) -> None:
        """Append sampled tokens, finish requests, free their KV, record output rows."""
        rows = self._in_flight.pop(result.step, None)
        if rows is None:
            self._log.warning("dropped a result for unknown step %d", result.step)
            return
        error = result.error
        num_sampled = sum(row.sample for row in rows)
        if error is None and len(result.token_ids) != num_sampled:
            error = f"worker returned {len(result.token_ids)} tokens for {num_sampled} sampled rows"
        if error is not None:
            self._fail_rows(result.step, rows, error)
            return
        k = 0
        for row in rows:
            token = result.token_ids[k] if row.sample else None
            logprob = result.logprobs[k] if row.sample and k < len(result.logprobs) else 0.0
            k += row.sample
            self._apply_row(row, token, logprob)

    def _apply_row(self, row: Row, token: int | None, logprob: float) -> None:
        req = row.req
        req.in_flight = False
        if req.status is ReqStatus.FINISHED:  # aborted while in flight: its token is dropped
            self._release(req)
            return
        req.kv_len += row.extend_len
        if token is None:
            return
        req.output_ids.append(token)
        self.num_generated_tokens += 1
        reason = req.finish_reason_after_token(self.config.context_len)
        self._outputs.add_token(req.rid, token, logprob, reason)
        if reason is not None:
            self.running.remove(req)
            self._finish(req, reason)

    def _fail_rows(self, step: int, rows: list[Row], error: str) -> None:
        self._log.error("forward step %d failed (%s): failing its %d requests", step, error, len(rows))
        for row in rows:
            req = row.req
            req.in_flight = False
            if req.status is ReqStatus.FINISHED:
                self._release(req)
                continue
            self._remove_from_queues(req)
            self._finish(req, FinishReason.ERROR)
            self._outputs.add_error(req.rid, f"forward pass failed: {error}")

    # ------------------------------------------------------------------ bookkeeping

    def _remove_from_queues(self, req: Req) -> None:
        if req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        elif req is self.chunked_req:
            self.chunked_req = None
        else:
            self.running.remove(req)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        del self.reqs[req.rid]
        self.num_finished += 1
        if not req.in_flight:
            self._release(req)

    def _release(self, req: Req) -> None:
        self.pages.free(req.page_table)
        req.page_table = []
        if req.slot is not None:
            self.slots.free(req.slot)
            req.slot = None

    # ------------------------------------------------------------------ counters for logs

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def used_kv_tokens(self) -> int:
        return self.pages.num_used * self.config.page_size

    @property
    def token_usage(self) -> float:
        return self.pages.num_used / max(self.pages.num_pages, 1)
