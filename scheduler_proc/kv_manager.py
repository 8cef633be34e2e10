"""Which KV pages and request slots each request holds: grow, release, report usage.

The scheduler decides who runs; this object owns the page and slot ids and is
the only code that takes or gives them back, so the invariant
``free pages + pages in requests' page tables == num_pages`` has one keeper.
"""

from __future__ import annotations

from scheduler_proc.config import SchedulerConfig
from scheduler_proc.page_allocator import PageAllocator, SlotPool, pages_for
from scheduler_proc.request import Req


class KVManager:
    """Page tables of live requests over one PageAllocator and one SlotPool."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.page_size = config.page_size
        self.pages = PageAllocator(config.num_pages)
        self.slots = SlotPool(config.max_running_requests)

    def assign_slot(self, req: Req) -> None:
        assert req.slot is None, f"rid {req.rid} already has slot {req.slot}"
        req.slot = self.slots.alloc()
        assert req.slot is not None, f"rid {req.rid}: admitted without a free slot"

    def grow(self, req: Req, extend_len: int) -> tuple[int, list[int]]:
        """Pages for ``req``'s next ``extend_len`` tokens: (index in its page table, the new pages)."""
        page_start = len(req.page_table)
        num_new = max(pages_for(req.kv_len + extend_len, self.page_size) - page_start, 0)
        new_pages = self.pages.alloc(num_new)
        assert new_pages is not None, f"rid {req.rid}: scheduled without free pages"
        req.page_table.extend(new_pages)
        return page_start, new_pages

    def decode_pages_needed(self, running: list[Req]) -> int:
        """New pages the next decode step takes: one per request whose next token starts a page."""
        return sum(1 for r in running if r.kv_len >= len(r.page_table) * self.page_size)

    def release(self, req: Req) -> None:
        """Give back everything ``req`` holds (its KV is gone; a retracted request recomputes it)."""
        self.pages.free(req.page_table)
        req.page_table = []
        if req.slot is not None:
            self.slots.free(req.slot)
            req.slot = None

    @property
    def num_free_pages(self) -> int:
        return self.pages.num_free

    @property
    def used_tokens(self) -> int:
        return self.pages.num_used * self.page_size

    @property
    def usage(self) -> float:
        return self.pages.num_used / max(self.pages.num_pages, 1)
