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

The choices forking from an n > 1 request (``Req.forks``) are admitted with it:
one req_pool_idx each, and their own prompt pages and reserved output counted with its.
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple

from scheduler_proc.config import SchedulerConfig
from scheduler_proc.page_allocator import pages_for
from scheduler_proc.request import Req


class AddResult(enum.Enum):
    """Whether the round has room for more after an offer, or what it lacked."""

    CONTINUE = "continue"  # admitted; budgets left for more
    NO_TOKEN = "no_token"  # KV (with reservations) cannot hold it
    NO_REQ_POOL_IDX = "no_req_pool_idx"  # max_running_requests reached
    NO_BUDGET = "no_budget"  # the input or chunk budget is spent or too small, or the chunked_req is taken


class AddOutcome(NamedTuple):
    """What ``add_one_req`` did with a request: admitted (``extend_len`` tokens) or refused."""

    extend_len: int  # tokens the request extends this round; 0: refused
    result: AddResult  # after an admission: whether more may follow; after a refusal: why

    @property
    def admitted(self) -> bool:
        return self.extend_len > 0


class Admitted(NamedTuple):
    req: Req
    extend_len: int  # tokens it extends this round


REFUSED_NO_SLOT = AddOutcome(0, AddResult.NO_REQ_POOL_IDX)
REFUSED_NO_TOKEN = AddOutcome(0, AddResult.NO_TOKEN)
REFUSED_NO_BUDGET = AddOutcome(0, AddResult.NO_BUDGET)


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
        available_pages: int,
        free_req_pool_idxs: int,
    ) -> None:
        self.page_size = page_size
        self.clip_max_new_tokens = clip_max_new_tokens
        self.rem_input_tokens = rem_input_tokens
        self.rem_chunk_tokens = rem_chunk_tokens
        self.rem_total_tokens = rem_total_tokens
        # The hard limit: free plus evictable pages, what allocation can get (KVManager.available_pages).
        self.available_pages = available_pages
        self.free_req_pool_idxs = free_req_pool_idxs
        self.can_run_list: list[Admitted] = []  # in the order admitted
        self.new_chunked_req: Req | None = None
        self.chunked_in_progress = False  # the old chunked_req still has chunks after this round

    @classmethod
    def for_round(
        cls,
        config: SchedulerConfig,
        running: list[Req],
        new_token_ratio: float,
        available_pages: int,
        free_req_pool_idxs: int,
        draft_tokens: int = 0,
    ) -> PrefillAdder:
        """This round's budgets: KV is what is free minus the running requests' reservation; the
        input budget is what the round's drafted tokens (verify rows) left of max_prefill_tokens."""
        return cls(
            page_size=config.page_size,
            clip_max_new_tokens=config.clip_max_new_tokens,
            rem_input_tokens=config.max_prefill_tokens - draft_tokens,
            rem_chunk_tokens=config.chunk_tokens,
            rem_total_tokens=available_pages * config.page_size
            - running_reservation_tokens(running, config, new_token_ratio),
            available_pages=available_pages,
            free_req_pool_idxs=free_req_pool_idxs,
        )

    def on_evictable_change(self, delta_pages: int) -> None:
        """A prefix lock (< 0) or unlock (> 0) changed how many cached pages eviction could free."""
        self.rem_total_tokens += delta_pages * self.page_size
        self.available_pages += delta_pages

    def _new_pages(self, req: Req, tokens: int) -> int:
        """Pages ``req`` needs beyond its page table to hold ``kv_len + tokens`` positions."""
        return max(pages_for(req.kv_len + tokens, self.page_size) - len(req.page_table), 0)

    def _take(self, req: Req, extend_len: int, reserve: int) -> None:
        self.can_run_list.append(Admitted(req, extend_len))
        self.rem_input_tokens -= extend_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_len
        new_pages, reserved_pages = (
            self._new_pages(req, extend_len),
            self._new_pages(req, extend_len + reserve),
        )
        if req.req_pool_idx is None:  # its first admission: its forks come in with it
            self.free_req_pool_idxs -= 1 + len(req.forks)
            new_pages += req.fork_pages(self.page_size, 0)
            reserved_pages += req.fork_pages(self.page_size, reserve)
        self.rem_total_tokens -= reserved_pages * self.page_size
        self.available_pages -= new_pages
        assert self.available_pages >= 0, "admitted more pages than are available"

    def _admitted(self, req: Req, extend_len: int, reserve: int) -> AddOutcome:
        self._take(req, extend_len, reserve)
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddOutcome(extend_len, AddResult.NO_BUDGET)
        if self.free_req_pool_idxs <= 0:
            return AddOutcome(extend_len, AddResult.NO_REQ_POOL_IDX)
        return AddOutcome(extend_len, AddResult.CONTINUE)

    def add_chunked_req(self, req: Req) -> int:
        """Continue the chunked request first; returns the tokens it extends this round (0: none).

        Afterwards ``chunked_in_progress`` says whether it still has chunks to go.

        Its chunk is bounded by the chunk budget, by ``rem_total_tokens`` when
        that is positive (SGLang), and always by the pages actually free. When no
        page is free it waits this round and nothing else is admitted behind it.
        """
        remaining = req.extend_input_len
        budget = remaining if self.rem_chunk_tokens is None else self.rem_chunk_tokens
        if self.rem_total_tokens > 0:
            budget = min(budget, int(self.rem_total_tokens))
        held_room = len(req.page_table) * self.page_size - req.kv_len
        budget = min(budget, remaining, held_room + self.available_pages * self.page_size)
        if budget <= 0:
            self.rem_chunk_tokens = 0
            self.chunked_in_progress = True
            return 0
        truncated = budget < remaining
        budget = req.chunk_before_image(budget) if truncated else budget
        self._take(req, budget, 0 if truncated else req.reserve_tokens(self.clip_max_new_tokens))
        self.chunked_in_progress = truncated
        return budget

    def add_one_req(self, req: Req, *, whole_only: bool = False) -> AddOutcome:
        """Admit a waiting request whole, truncated (new chunked_req), or not at all.

        ``whole_only`` (pack's greedy pass): admit only if the whole prompt fits what
        is left of the input and chunk budgets, never truncated or over budget.
        """
        if self.free_req_pool_idxs < 1 + len(req.forks):
            return REFUSED_NO_SLOT
        extend = req.extend_input_len
        reserve = req.reserve_tokens(self.clip_max_new_tokens)
        pages = self._new_pages(req, extend + reserve) + req.fork_pages(self.page_size, reserve)
        if pages * self.page_size > self.rem_total_tokens:
            return REFUSED_NO_TOKEN
        if whole_only and (
            extend > self.rem_input_tokens
            or (self.rem_chunk_tokens is not None and extend > self.rem_chunk_tokens)
        ):
            return REFUSED_NO_BUDGET
        if self.rem_chunk_tokens is None or extend <= self.rem_chunk_tokens:
            # Over the input budget only when alone in the round: a prompt larger
            # than max_prefill_tokens must still run some day.
            if extend > self.rem_input_tokens and self.can_run_list:
                return REFUSED_NO_BUDGET
            return self._admitted(req, extend, reserve)
        if self.chunked_in_progress or self.new_chunked_req is not None:
            return REFUSED_NO_BUDGET  # at most one chunked_req at a time
        trunc_len = self.rem_chunk_tokens
        if self.can_run_list:
            trunc_len = min(trunc_len, self.rem_input_tokens)
        if trunc_len <= 0:
            return REFUSED_NO_BUDGET
        self.new_chunked_req = req
        return self._admitted(req, req.chunk_before_image(trunc_len), 0)


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
