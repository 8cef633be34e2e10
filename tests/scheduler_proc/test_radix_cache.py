"""The radix tree alone: match/insert/split at page boundaries, locks, LRU eviction, integrity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_proc.radix_cache import RadixCache


class Pool:
    """Hands out page ids and records what the tree frees."""

    def __init__(self) -> None:
        self.next_page = 0
        self.freed: list[int] = []

    def take(self, n: int) -> list[int]:
        pages = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        return pages

    def free(self, pages: list[int]) -> None:
        self.freed.extend(pages)


def cache(page_size: int) -> tuple[RadixCache, Pool]:
    pool = Pool()
    return RadixCache(page_size, pool.free), pool


@pytest.mark.parametrize("ps", [1, 16])
def test_match_and_insert_in_whole_pages(ps: int) -> None:
    tree, pool = cache(ps)
    a = list(range(100, 100 + 4 * ps))
    pages_a = pool.take(4)
    assert tree.insert(a, pages_a) == 0, "nothing was cached"
    assert tree.match_prefix(a).pages == pages_a
    assert tree.match_prefix(a + [7] * (ps - 1)).pages == pages_a, "a partial last page never matches"
    assert tree.match_prefix(a[: 3 * ps + ps - 1]).pages == pages_a[:3]
    # b shares a's first two pages, then differs inside its third page.
    b = a[: 2 * ps] + [5] + a[2 * ps + 1 :]
    m = tree.match_prefix(b)
    assert m.pages == pages_a[:2] and m.node.pages == pages_a[:2], "split exactly at the matched pages"
    pages_b = pool.take(4)
    assert tree.insert(b, pages_b) == 2, "b's first two pages were already there: b's own are duplicates"
    assert tree.match_prefix(b).pages == pages_a[:2] + pages_b[2:]
    assert tree.match_prefix(a).pages == pages_a
    assert tree.evictable_pages == 6 and tree.protected_pages == 0
    tree.check_integrity()


def test_namespaces_never_share() -> None:
    tree, pool = cache(4)
    tokens = list(range(16))
    pages = pool.take(4)
    tree.insert(tokens, pages, namespace="tenant-a")
    assert tree.match_prefix(tokens, namespace="tenant-a").pages == pages
    assert tree.match_prefix(tokens, namespace="tenant-b").pages == []
    assert tree.match_prefix(tokens).pages == [], "no namespace is its own namespace"
    tree.check_integrity()


def test_locks_protect_a_path_and_eviction_is_lru_over_unlocked_leaves() -> None:
    tree, pool = cache(2)
    base = [1, 2, 3, 4]
    x, y, z = base + [5, 6], base + [7, 8], [9, 9, 9, 9]
    px = pool.take(3)
    tree.insert(x, px)
    py = pool.take(3)
    tree.insert(y, py)  # shares x's first two pages
    pz = pool.take(2)
    tree.insert(z, pz)
    assert tree.evictable_pages == 3 + 1 + 2
    locked = tree.match_prefix(y).node
    assert tree.inc_lock_ref(locked) == -3, "y's leaf and the shared base become protected"
    assert (tree.evictable_pages, tree.protected_pages) == (3, 3)
    tree.match_prefix(z)  # z is now more recent than x
    assert tree.evict(1) == 1 and pool.freed == px[2:], "x's leaf: the least recently used unlocked leaf"
    assert tree.evict(10) == 2 and pool.freed == px[2:] + pz, "then z; the locked path stays"
    assert tree.match_prefix(y).pages == px[:2] + py[2:]
    tree.check_integrity()
    assert tree.dec_lock_ref(locked) == 3
    assert tree.flush() == 3 and tree.total_pages == 0
    tree.check_integrity()


def test_lock_survives_a_split_of_the_locked_edge() -> None:
    tree, pool = cache(1)
    tree.insert([1, 2, 3, 4], pool.take(4))
    node = tree.match_prefix([1, 2, 3, 4]).node
    tree.inc_lock_ref(node)
    tree.match_prefix([1, 2, 9])  # splits the locked edge after two pages
    tree.check_integrity()
    assert tree.protected_pages == 4 and tree.evict(4) == 0
    tree.dec_lock_ref(node)
    tree.check_integrity()
    assert tree.evict(4) == 4


OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "lock", "unlock", "evict", "flush"]),
        st.lists(st.integers(0, 3), min_size=0, max_size=12),  # small alphabet: many shared prefixes
        st.integers(0, 6),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ps=st.sampled_from([1, 2, 4]), ops=OPS)
def test_random_operations_keep_the_tree_consistent(ps: int, ops: list[tuple[str, list[int], int]]) -> None:
    """Against a model: every page is free, or in the tree exactly once; matches return what was inserted."""
    tree, pool = cache(ps)
    content: dict[int, tuple[int, ...]] = {}  # page -> the tokens up to and including it
    locks = []
    for op, tokens, n in ops:
        if op == "insert":
            pages = pool.take(len(tokens) // ps)
            for i, page in enumerate(pages):
                content[page] = tuple(tokens[: (i + 1) * ps])
            dup = tree.insert(tokens, pages)
            pool.free(pages[:dup])  # the caller frees its duplicates
        elif op == "lock":
            locks.append(tree.match_prefix(tokens).node)
            tree.inc_lock_ref(locks[-1])
        elif op == "unlock" and locks:
            tree.dec_lock_ref(locks.pop(n % len(locks)))
        elif op == "evict":
            tree.evict(n)
        elif op == "flush":
            tree.flush()
        tree.check_integrity()
        match = tree.match_prefix(tokens)
        for i, page in enumerate(match.pages):
            assert content[page] == tuple(tokens[: (i + 1) * ps]), "a page matched for other tokens"
        assert len(pool.freed) == len(set(pool.freed)), "a page freed twice"
        assert not set(pool.freed) & {p for node in tree._nodes() for p in node.pages}, (
            "freed but in the tree"
        )
        assert tree.total_pages + len(pool.freed) == pool.next_page, "a page leaked"
    for node in locks:
        tree.dec_lock_ref(node)
    tree.flush()
    assert tree.total_pages == 0 and sorted(pool.freed) == list(range(pool.next_page))
