"""One round's prefill admission budget, after SGLang's ``PrefillAdder``.

Three budgets, all in tokens:

- ``rem_input_tokens``: prompt tokens this round may prefill (max_prefill_tokens);
  one request is always admitted alone even when larger, so nothing starves.
- ``rem_chunk_tokens``: the chunk budget (None: chunking off); a request longer
  than what is left is truncated and becomes the new ``chunked_req``.
- ``rem_total_tokens``: free KV minus what running requests are expected to
  still write. A request is admitted only if its whole remaining prompt plus its
  reserved output fits here, rounded up to whole pages; a truncated chunk is
  charged its own pages only (its output is reserved once its last chunk runs).
"""

from __future__ import annotations

import enum
import math

from scheduler_proc.config import SchedulerConfig
from scheduler_proc.page_allocator import pages_for
from scheduler_proc.request import Req


class AddResult(enum.Enum):
    CONTINUE = "continue"  # admitted; budgets left for more
    NO_TOKEN = "no_token"  # KV (with reservations) cannot hold it
    NO_SLOT = "no_slot"  # max_running_requests reached
    OTHER = "other"  # input or chunk budget spent


class PrefillAdder:
    """Decides which requests prefill this round, and how many tokens each extends."""

    def __init__(
        self,
        *,
        page_size: int,
        clip_max_new_tokens: int,
        rem_input_tokens: int,
        rem_chunk_tokens: int | None,
        rem_total_tokens: float,
        free_pages: int,
        free_slots: int,
    ) -> None:
        self.page_size = page_size
        self.clip_max_new_tokens = clip_max_new_tokens
        self.rem_input_tokens = rem_input_tokens
        self.rem_chunk_tokens = rem_chunk_tokens
        self.rem_total_tokens = rem_total_tokens
        self.free_pages = free_pages  # hard limit: free plus evictable pages, what allocation can get
        self.free_slots = free_slots
        self.can_run_list: list[tuple[Req, int]] = []  # (request, tokens it extends this round)
        self.new_chunked_req: Req | None = None
        self.chunked_in_progress = False  # the old chunked_req still has chunks after this round

    @classmethod
    def for_round(
        cls,
        config: SchedulerConfig,
        running: list[Req],
        new_token_ratio: float,
        free_pages: int,
        free_slots: int,
    ) -> PrefillAdder:
        """This round's budgets: KV is what is free minus the running requests' reservation."""
        return cls(
            page_size=config.page_size,
            clip_max_new_tokens=config.clip_max_new_tokens,
            rem_input_tokens=config.max_prefill_tokens,
            rem_chunk_tokens=config.chunk_tokens,
            rem_total_tokens=free_pages * config.page_size
            - running_reservation_tokens(running, config, new_token_ratio),
            free_pages=free_pages,
            free_slots=free_slots,
        )

    def on_evictable_change(self, delta_pages: int) -> None:
        """A prefix lock (< 0) or unlock (> 0) changed how many cached pages eviction could free."""
        self.rem_total_tokens += delta_pages * self.page_size
        self.free_pages += delta_pages

    def _new_pages(self, req: Req, tokens: int) -> int:
        """Pages ``req`` needs beyond its page table to hold ``kv_len + tokens`` positions."""
        return max(pages_for(req.kv_len + tokens, self.page_size) - len(req.page_table), 0)

    def _take(self, req: Req, extend_len: int, reserve: int) -> None:
        self.can_run_list.append((req, extend_len))
        self.rem_input_tokens -= extend_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_len
        self.rem_total_tokens -= self._new_pages(req, extend_len + reserve) * self.page_size
        self.free_pages -= self._new_pages(req, extend_len)
        if req.slot is None:
            self.free_slots -= 1
        assert self.free_pages >= 0, "admitted more pages than are free"

    def _budget_state(self) -> AddResult:
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddResult.OTHER
        if self.free_slots <= 0:
            return AddResult.NO_SLOT
        return AddResult.CONTINUE

    def add_chunked_req(self, req: Req) -> Req | None:
        """Continue the chunked request first; returns it while chunks remain, else None.

        Its chunk is bounded by the chunk budget, by ``rem_total_tokens`` when
        that is positive (SGLang), and always by the pages actually free. When no
        page is free it waits this round and nothing else is admitted behind it.
        """
        remaining = req.extend_input_len
        budget = remaining if self.rem_chunk_tokens is None else self.rem_chunk_tokens
        if self.rem_total_tokens > 0:
            budget = min(budget, int(self.rem_total_tokens))
        held_room = len(req.page_table) * self.page_size - req.kv_len
        budget = min(budget, remaining, held_room + self.free_pages * self.page_size)
        if budget <= 0:
            self.rem_chunk_tokens = 0
            self.chunked_in_progress = True
            return req
        truncated = budget < remaining
        self._take(req, budget, 0 if truncated else req.reserve_tokens(self.clip_max_new_tokens))
        self.chunked_in_progress = truncated
        return req if truncated else None

    def add_one_req(self, req: Req, *, whole_only: bool = False) -> AddResult:
        """Admit a waiting request whole, truncated (new chunked_req), or not at all.

        ``whole_only`` (pack's greedy pass): admit only if the whole prompt fits what
        is left of the input and chunk budgets, never truncated or over budget.
        Whether ``req`` got in shows in ``can_run_list``, not in the result, which
        says whether more may follow.
        """
        if self.free_slots <= 0:
            return AddResult.NO_SLOT
        extend = req.extend_input_len
        reserve = req.reserve_tokens(self.clip_max_new_tokens)
        if self._new_pages(req, extend + reserve) * self.page_size > self.rem_total_tokens:
            return AddResult.NO_TOKEN
        if whole_only and (
            extend > self.rem_input_tokens
            or (self.rem_chunk_tokens is not None and extend > self.rem_chunk_tokens)
        ):
            return AddResult.OTHER
        if self.rem_chunk_tokens is None or extend <= self.rem_chunk_tokens:
            # Over the input budget only when alone in the round: a prompt larger
            # than max_prefill_tokens must still run some day.
            if extend > self.rem_input_tokens and self.can_run_list:
                return AddResult.OTHER
            self._take(req, extend, reserve)
            return self._budget_state()
        if self.chunked_in_progress or self.new_chunked_req is not None:
            return AddResult.OTHER  # at most one chunked_req at a time
        trunc_len = self.rem_chunk_tokens
        if self.can_run_list:
            trunc_len = min(trunc_len, self.rem_input_tokens)
        if trunc_len <= 0:
            return AddResult.OTHER
        self._take(req, trunc_len, 0)
        self.new_chunked_req = req
        return self._budget_state()


def running_reservation_tokens(running: list[Req], config: SchedulerConfig, new_token_ratio: float) -> int:
    """KV the running requests are expected to still write, in whole pages (as tokens).

    Per request: ``min(max_new_tokens - generated, clip_max_new_tokens) * new_token_ratio``
    future tokens; room left in its own last page costs nothing more.
    """
    ps = config.page_size
    reserved = 0
    for req in running:
        future = math.ceil(req.reserve_tokens(config.clip_max_new_tokens) * new_token_ratio)
        reserved += max(pages_for(req.kv_len + future, ps) - len(req.page_table), 0) * ps
    return reserved
