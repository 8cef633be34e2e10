"""KV bookkeeping on the scheduler side: which pages and page-table rows are free.

The worker owns the memory; the scheduler owns the ids. A page id ``p`` names
KV locations (rows of the K/V pool) ``[p * page_size, (p + 1) * page_size)``; a request's
``req_pool_idx`` names its row of the worker's page table.
"""

from __future__ import annotations


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` positions starting at a page boundary."""
    return -(-num_tokens // page_size)


class PageAllocator:
    """Free list of ``num_pages`` KV page ids; double frees are caught."""

    def __init__(self, num_pages: int) -> None:
        assert num_pages >= 0, "num_pages must be >= 0"
        self.num_pages = num_pages
        # Reversed so that the lowest ids come out first: easier to read in logs and tests.
        self._free = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` page ids, or None (and nothing taken) when fewer are free."""
        assert n >= 0, f"cannot allocate {n} pages"
        if n > len(self._free):
            return None
        pages = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        pages.reverse()
        for page in pages:
            self._is_free[page] = 0
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            assert 0 <= page < self.num_pages, f"page {page} out of range"
            assert not self._is_free[page], f"page {page} freed twice"
            self._is_free[page] = 1
        self._free.extend(reversed(pages))


class ReqPool:
    """The ``max_running_requests`` rows of the worker's page table, by req_pool_idx."""

    def __init__(self, size: int) -> None:
        assert size >= 1, "need at least one page-table row"
        self.size = size
        self._free = list(range(size - 1, -1, -1))
        self._is_free = [True] * size

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        idx = self._free.pop()
        self._is_free[idx] = False
        return idx

    def free(self, idx: int) -> None:
        assert 0 <= idx < self.size, f"req_pool_idx {idx} out of range"
        assert not self._is_free[idx], f"req_pool_idx {idx} freed twice"
        self._is_free[idx] = True
        self._free.append(idx)
