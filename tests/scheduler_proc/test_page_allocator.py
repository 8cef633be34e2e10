from __future__ import annotations

import pytest

from scheduler_proc.page_allocator import PageAllocator, ReqPool


def test_alloc_returns_distinct_pages_until_short() -> None:
    alloc = PageAllocator(5)
    a = alloc.alloc(3)
    assert a is not None and len(set(a)) == 3
    assert alloc.num_free == 2 and alloc.num_used == 3
    assert alloc.alloc(3) is None, "asking for more than is free takes nothing"
    assert alloc.num_free == 2
    b = alloc.alloc(2)
    assert b is not None and not set(a) & set(b)
    assert alloc.alloc(1) is None
    alloc.free(a)
    assert alloc.num_free == 3
    c = alloc.alloc(3)
    assert c is not None and sorted(c) == sorted(a)


def test_alloc_zero_and_double_free() -> None:
    alloc = PageAllocator(2)
    assert alloc.alloc(0) == []
    pages = alloc.alloc(1)
    assert pages is not None
    alloc.free(pages)
    with pytest.raises(AssertionError, match="freed twice"):
        alloc.free(pages)
    with pytest.raises(AssertionError, match="out of range"):
        alloc.free([7])


def test_req_pool() -> None:
    pool = ReqPool(2)
    s0, s1 = pool.alloc(), pool.alloc()
    assert s0 is not None and s1 is not None and s0 != s1
    assert pool.alloc() is None and pool.num_free == 0
    pool.free(s0)
    assert pool.alloc() == s0
    pool.free(s1)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(s1)
