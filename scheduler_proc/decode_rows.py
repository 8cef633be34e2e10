"""The decode half of the Scheduler: a row for each running request (a verify row where it drafts),
the drafts those rows carry, and the retractions that make room for them.

A mixin of ``Scheduler`` (scheduler.py), which owns the state declared here.
"""

from __future__ import annotations

import logging
from collections import deque

from scheduler_proc.batch import Row
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.kv_manager import KVManager
from scheduler_proc.page_allocator import pages_for
from scheduler_proc.request import Req
from scheduler_proc.retraction import pick_victim, retract
from scheduler_proc.speculative import first_draft_length
from scheduler_proc.token_ratio import NewTokenRatio


class DecodeRows:
    """Builds the decode rows of a batch (the state is the Scheduler's)."""

    config: SchedulerConfig
    kv: KVManager
    waiting: deque[Req]
    running: list[Req]
    new_token_ratio: NewTokenRatio
    num_retracted: int
    last_batch_rows: int  # decode rows of the last batch that had some
    _in_flight: dict[int, list[Row]]
    _log: logging.Logger

    def _extend_row(
        self,
        req: Req,
        extend_len: int,
        new_req_pool_idx: bool,
        is_prefill: bool,
        draft: list[int] | None = None,
    ) -> Row:
        """A row extending ``req`` by ``extend_len`` tokens (``draft`` the last of them), with the
        pages they need."""
        draft = draft or []
        page_start, new_pages = self.kv.grow(req, extend_len)
        sample = req.kv_len + extend_len - len(draft) == req.seq_len and req.max_new_tokens > 0
        return Row(req, extend_len, sample, page_start, new_pages, new_req_pool_idx, is_prefill, draft=draft)

    def _decode_rows(self) -> list[Row]:
        """One decode row per running request (a verify row where it drafts); the ratio decays on a
        step that needed no retraction."""
        retracted, decoders = self._make_room_for_decodes()
        self.last_batch_rows = len(decoders) or self.last_batch_rows
        drafts = self._drafts(decoders) if self.config.speculative else {}
        rows = []
        for req in decoders:
            assert req.is_decoding, f"rid {req.rid}: running but not at a decode step"
            draft = drafts.get(req.rid, [])
            rows.append(
                self._extend_row(req, 1 + len(draft), new_req_pool_idx=False, is_prefill=False, draft=draft)
            )
            if req.draft is not None:
                req.draft.on_decode_step()
        if rows and not retracted:
            self.new_token_ratio.on_decode_step()
        return rows

    def _drafts(self, decoders: list[Req]) -> dict[int, list[int]]:
        """rid -> the draft each drafting request's verify row carries this step, within the pages
        left after every decode's own (no draft retracts or waits for KV) and half the round's input
        budget (the prefill admitted beside them gets the rest)."""
        cfg, ps = self.config, self.config.page_size
        spare_pages = self.kv.available_pages - self.kv.decode_pages_needed(decoders)
        budget = cfg.max_prefill_tokens // 2
        first = first_draft_length(cfg.speculative_num_draft_tokens, len(decoders), cfg.speculative_row_cost)
        drafts: dict[int, list[int]] = {}
        for req in decoders:
            if not req.wants_draft or req.flight.rows or budget <= 0:
                continue
            assert req.draft is not None
            held = max(len(req.page_table), pages_for(req.kv_len + 1, ps))  # with the decode's own page
            room = (held + spare_pages) * ps - req.kv_len - 1
            limit = min(cfg.speculative_num_draft_tokens, req.max_draft_tokens(cfg.context_len), room, budget)
            draft = req.draft.propose(req.fill_slice(req.draft.num_known, req.seq_len), limit, first)
            if draft:
                drafts[req.rid] = draft
                spare_pages -= max(pages_for(req.kv_len + 1 + len(draft), ps) - held, 0)
                budget -= len(draft)
        return drafts

    def _decoders(self) -> list[Req]:
        """Running requests that get a decode row: all but those whose last token is being drawn, and
        those that draft with a row in flight (a draft needs every token of its request: it skips
        this batch and drafts in the next, while the others stay overlapped)."""
        return [
            req
            for req in self.running
            if not req.flight.final_scheduled and not (req.wants_draft and req.flight.rows)
        ]

    def _decode_needs_retraction(self) -> bool:
        return self.kv.decode_pages_needed(self._decoders()) > self.kv.available_pages

    def _make_room_for_decodes(self) -> tuple[bool, list[Req]]:
        """Retract running requests until every decode that crosses into a new page gets one; whether
        any was retracted, and the requests that get a decode row (``_decoders``)."""
        retracted = False
        decoders = self._decoders()
        while self.running:
            if self.kv.decode_pages_needed(decoders) <= self.kv.available_pages:
                break
            assert not self._in_flight, "retraction with a batch in flight"
            retract(pick_victim(self.running), self.running, self.waiting, self.kv)
            self.num_retracted += 1
            retracted = True
            decoders = self._decoders()
        if retracted:
            old = self.new_token_ratio.value
            self.new_token_ratio.on_retract()
            self._log.warning("new_token_ratio raised %.3f -> %.3f", old, self.new_token_ratio.value)
        return retracted, decoders
