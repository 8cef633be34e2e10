"""Which KV pages and page-table row (req_pool_idx) each request holds: prefix hits, growth, caching, release.

A request's page table is ``[tree pages | own pages]``:

    page_table[:num_tree_pages]  pages of the radix cache, on the path of ``cache_node``,
                                 which the request keeps locked (protected from eviction)
    page_table[num_tree_pages:]  pages only this request holds

so every page is exactly one of: free, evictable (tree, unlocked), protected
(tree, locked) or owned by one request, and ``check_integrity`` asserts the sum.
The scheduler decides who runs; this object is the only code that takes or
gives back page ids and req_pool_idx.
"""

from __future__ import annotations

from typing import Protocol

from scheduler_proc.config import SchedulerConfig
from scheduler_proc.page_allocator import PageAllocator, ReqPool, pages_for
from scheduler_proc.radix_cache import RadixCache
from scheduler_proc.request import Req


class EvictableAccount(Protocol):
    """Who counts the pages eviction could free this round (the PrefillAdder)."""

    def on_evictable_change(self, delta_pages: int) -> None: ...


class KVManager:
    """Page tables of live requests over a PageAllocator, a ReqPool and (unless disabled) a RadixCache."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.page_size = config.page_size
        self.pages = PageAllocator(config.num_pages)
        self.req_pool = ReqPool(config.max_running_requests)
        self.cache = RadixCache(config.page_size, self.pages.free) if config.prefix_cache else None

    # ------------------------------------------------------------------ prefix hits

    def peek_prefix_len(self, req: Req) -> int:
        """Tokens of ``req`` a prefix hit would skip now (nothing is locked)."""
        if self.cache is None or req.seq_len < 2 or req.needs_every_prompt_position:
            return 0
        return (
            self.cache.match_prefix(req.key_slice(0, req.seq_len - 1), req.cache_salt).num_pages
            * self.page_size
        )

    def attach_prefix(self, req: Req, account: EvictableAccount) -> None:
        """Give a waiting request its cached prefix (pages, kv_len) and lock it, telling ``account``
        how many evictable pages the lock took. ``detach_prefix`` undoes both.

        At least one token is left to compute: the last one's forward draws the next token.
        A request that still needs its prompt logprobs (or a MEAN-pooled embedding, the same way)
        gets no prefix: they are computed only by
        a forward over every prompt position (the simple choice, over recomputing what the cache
        skipped; its pages still enter the cache for others).
        """
        assert not req.page_table and req.kv_len == 0 and req.cache_node is None, f"rid {req.rid} holds KV"
        if self.cache is None or req.seq_len < 2 or req.needs_every_prompt_position:
            return
        match = self.cache.match_prefix(req.key_slice(0, req.seq_len - 1), req.cache_salt)
        req.page_table = list(match.pages)
        req.num_tree_pages = match.num_pages
        req.flight.reset(match.num_pages * self.page_size)
        req.cache_node = match.node
        account.on_evictable_change(self.cache.inc_lock_ref(match.node))

    def detach_prefix(self, req: Req, account: EvictableAccount) -> None:
        """Undo ``attach_prefix`` for a request not admitted, giving ``account`` its pages back."""
        assert req.num_tree_pages == len(req.page_table), f"rid {req.rid} already has pages of its own"
        account.on_evictable_change(self._unlock(req))
        req.page_table, req.num_tree_pages = [], 0
        req.flight.reset()

    # ------------------------------------------------------------------ growth

    def assign_req_pool_idx(self, req: Req) -> None:
        assert req.req_pool_idx is None, f"rid {req.rid} already has req_pool_idx {req.req_pool_idx}"
        req.req_pool_idx = self.req_pool.alloc()
        assert req.req_pool_idx is not None, f"rid {req.rid}: admitted without a free req_pool_idx"
        req.flight.worker_pages = 0  # a fresh page-table row: the worker gets the whole page table

    def grow(self, req: Req, extend_len: int) -> tuple[int, list[int]]:
        """Pages for ``req``'s next ``extend_len`` tokens, evicting cached pages if short.

        Returns the page-table delta the worker has not seen: (start index, pages).
        """
        num_new = max(pages_for(req.kv_len + extend_len, self.page_size) - len(req.page_table), 0)
        flight = req.flight
        if not num_new and flight.worker_pages == len(req.page_table):  # most decode steps
            return flight.worker_pages, []
        self._make_free(num_new)
        new_pages = self.pages.alloc(num_new)
        assert new_pages is not None, f"rid {req.rid}: scheduled without free pages"
        req.page_table.extend(new_pages)
        start = req.flight.worker_pages
        req.flight.worker_pages = len(req.page_table)
        return start, req.page_table[start:]

    def admit_forks(self, req: Req) -> None:
        """A req_pool_idx and own prompt pages (still to be copied) for each choice forking from ``req``."""
        for fork in req.forks:
            self.assign_req_pool_idx(fork)
            num_pages = pages_for(fork.fork_tail_tokens, self.page_size)
            self._make_free(num_pages)
            pages = self.pages.alloc(num_pages)
            assert pages is not None, f"rid {fork.rid}: admitted without free pages"
            fork.page_table = pages

    def attach_fork(self, fork: Req, leader: Req) -> None:
        """``fork``'s KV once its leader's prompt is computed: the leader's full prompt pages, shared
        through the prefix cache (where it put them as its prompt landed) and locked, ahead of the
        copies it owns."""
        num_prompt = len(fork.input_ids)
        num_shared = pages_for(num_prompt, self.page_size) - len(fork.page_table)
        if num_shared:
            assert self.cache is not None, f"rid {fork.rid}: shares prompt pages without a prefix cache"
            match = self.cache.match_prefix(leader.key_slice(0, num_shared * self.page_size), fork.cache_salt)
            assert match.num_pages == num_shared, f"rid {fork.rid}: the leader's prompt is not cached"
            self.cache.inc_lock_ref(match.node)
            fork.page_table = list(match.pages) + fork.page_table
            fork.cache_node, fork.num_tree_pages = match.node, num_shared
        fork.flight.reset(num_prompt)

    def roll_back(self, req: Req) -> None:
        """Free ``req``'s own pages past its KV: a verify row's pages for the drafts not taken (the
        worker's page-table entries past them are rewritten with the next pages it gets)."""
        keep = max(pages_for(req.kv_len, self.page_size), req.num_tree_pages)
        if len(req.page_table) > keep:
            self.pages.free(req.page_table[keep:])
            del req.page_table[keep:]
            req.flight.worker_pages = min(req.flight.worker_pages, keep)

    def decode_pages_needed(self, running: list[Req]) -> int:
        """New pages the next decode step takes: one per request whose next token starts a page."""
        return sum(1 for r in running if r.kv_len >= len(r.page_table) * self.page_size)

    def _make_free(self, num_pages: int) -> None:
        short = num_pages - self.pages.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)

    # ------------------------------------------------------------------ caching and release

    def cache_unfinished(self, req: Req) -> None:
        """Put ``req``'s computed full pages into the tree, so later requests can share them now.

        Only pages of returned batches (``computed_len``): their KV is written and
        their tokens known, where a batch in flight may still fail or hold PENDING.

        Where another request cached the same tokens first, ``req`` switches to the
        tree's pages and frees its duplicates (the worker gets the rewritten entries
        with the request's next row).
        """
        num_full = req.computed_len // self.page_size
        if self.cache is None or num_full <= req.num_tree_pages:
            return
        tokens = req.key_slice(0, num_full * self.page_size)
        num_dup = self.cache.insert(tokens, req.page_table[:num_full], req.cache_salt)
        match = self.cache.match_prefix(tokens, req.cache_salt)
        assert match.num_pages == num_full, f"rid {req.rid}: inserted pages do not match back"
        if num_dup > req.num_tree_pages:
            self.pages.free(req.page_table[req.num_tree_pages : num_dup])
            req.page_table[req.num_tree_pages : num_dup] = match.pages[req.num_tree_pages : num_dup]
            req.flight.worker_pages = min(req.flight.worker_pages, req.num_tree_pages)
        self.cache.inc_lock_ref(match.node)
        self._unlock(req)
        req.cache_node, req.num_tree_pages = match.node, num_full

    def release(self, req: Req, *, cache: bool) -> None:
        """Give back all ``req`` holds; with ``cache``, its computed full pages go to the tree first."""
        own_from = req.num_tree_pages
        num_full = req.computed_len // self.page_size
        if cache and self.cache is not None and num_full > req.num_tree_pages:
            tokens = req.key_slice(0, num_full * self.page_size)
            num_dup = self.cache.insert(tokens, req.page_table[:num_full], req.cache_salt)
            self.pages.free(req.page_table[req.num_tree_pages : max(num_dup, req.num_tree_pages)])
            own_from = num_full
        self.pages.free(req.page_table[own_from:])
        self._unlock(req)
        req.page_table, req.num_tree_pages, req.flight.worker_pages = [], 0, 0
        if req.req_pool_idx is not None:
            self.req_pool.free(req.req_pool_idx)
            req.req_pool_idx = None

    def flush_cache(self) -> int:
        """Evict every cached page no live request holds; returns how many were freed."""
        return self.cache.flush() if self.cache is not None else 0

    def _unlock(self, req: Req) -> int:
        node, req.cache_node = req.cache_node, None
        return self.cache.dec_lock_ref(node) if node is not None and self.cache is not None else 0

    # ------------------------------------------------------------------ accounting

    @property
    def evictable_pages(self) -> int:
        return self.cache.evictable_pages if self.cache is not None else 0

    @property
    def available_pages(self) -> int:
        """What allocation can get: free pages plus cached pages no live request holds."""
        return self.pages.num_free + self.evictable_pages

    @property
    def used_tokens(self) -> int:
        return (self.pages.num_used - self.evictable_pages) * self.page_size

    @property
    def usage(self) -> float:
        return (self.pages.num_used - self.evictable_pages) / max(self.pages.num_pages, 1)

    def check_integrity(self, holders: list[Req]) -> None:
        """free + evictable + protected + pages owned by ``holders`` == all pages (no page twice)."""
        owned = [p for req in holders for p in req.page_table[req.num_tree_pages :]]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        tree = 0
        if self.cache is not None:
            self.cache.check_integrity()
            tree = self.cache.total_pages
        assert self.pages.num_free + tree + len(owned) == self.pages.num_pages, (
            f"pages leaked: {self.pages.num_free} free + {tree} cached + {len(owned)} owned "
            f"!= {self.pages.num_pages}"
        )
