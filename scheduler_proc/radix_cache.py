"""A radix tree over token ids at page granularity: which KV pages already hold which prefixes.

Every edge holds a key of whole pages (``len(key) == len(pages) * page_size``) and
the page ids whose KV holds those tokens, so a match is always a whole number of
pages. Children are indexed by their first page of tokens. One tree per cache
namespace (a tenant's salt): requests of different namespaces never share a page.

Pages in the tree are either *protected* (on the path of a node some live request
has locked) or *evictable*; ``evict`` frees unlocked leaves, least recently used
first, back to the page allocator through the ``free_pages`` callback. The tree
never allocates: it only takes over pages that requests computed (``insert``).

A hybrid model's node may hold a recurrent-state ``checkpoint`` (scheduler_proc/state_checkpoints.py):
the state after exactly the tokens up to the node's end. A split keeps it on the lower node (which
still ends there); evicting the node frees it through ``free_checkpoint``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate


@dataclass(eq=False)
class TreeNode:
    """An edge of the tree and the node it leads to."""

    key: list[int]
    pages: list[int]
    parent: TreeNode | None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0  # live requests whose locked path runs through this node
    last_access: int = 0  # a logical clock: bigger is more recent
    checkpoint: int | None = None  # a recurrent-state checkpoint taken where this node ends


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix: its pages, and the node where it ends (the root for none)."""

    pages: list[int]
    node: TreeNode

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class RadixCache:
    """Prefix-sharing KV pages, keyed by (namespace, token ids), page-granular."""

    def __init__(
        self,
        page_size: int,
        free_pages: Callable[[list[int]], None],
        free_checkpoint: Callable[[int], None] | None = None,
    ) -> None:
        assert page_size >= 1, "page_size must be >= 1"
        self.page_size = page_size
        self._free_pages = free_pages
        self._free_checkpoint = free_checkpoint
        self._roots: dict[str | None, TreeNode] = {}
        self._no_match = TreeNode([], [], None)  # the node of an empty match; locking it is a no-op
        self._clock = 0
        self.evictable_pages = 0
        self.protected_pages = 0
        self.num_evicted_pages = 0  # since start, for tests and logs

    # ------------------------------------------------------------------ lookups and inserts

    def match_prefix(self, tokens: Sequence[int], namespace: str | None = None) -> PrefixMatch:
        """The longest prefix of ``tokens`` (in whole pages) whose KV is cached.

        A node matched only partly is split, so the returned node ends exactly at the match.
        """
        node = self._roots.get(namespace, self._no_match)
        pages: list[int] = []
        pos, end = 0, len(tokens) - len(tokens) % self.page_size
        while pos < end:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            n = self._common_pages(child, tokens, pos, end)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = self._tick()
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
        return PrefixMatch(pages, node)

    def insert(self, tokens: Sequence[int], pages: list[int], namespace: str | None = None) -> int:
        """Cache ``pages`` as holding ``tokens[:len(pages) * page_size]``.

        Returns how many leading pages the tree already had for these tokens: the
        caller's own pages among those are duplicates and remain the caller's to free.
        The tree takes over the rest.
        """
        end = len(pages) * self.page_size
        assert len(tokens) >= end, f"{len(pages)} pages need {end} tokens, got {len(tokens)}"
        node = self._roots.setdefault(namespace, TreeNode([], [], None))
        pos = 0
        while pos < end:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                leaf = TreeNode(list(tokens[pos:end]), pages[pos // self.page_size :], node)
                leaf.last_access = self._tick()
                node.children[self._page_key(leaf.key, 0)] = leaf
                self.evictable_pages += len(leaf.pages)
                return pos // self.page_size
            n = self._common_pages(child, tokens, pos, end)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = self._tick()
            pos += len(child.key)
            node = child
        return len(pages)

    # ------------------------------------------------------------------ locks and eviction

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Protect ``node``'s path from eviction; returns the change in evictable pages (<= 0)."""
        delta = 0
        while node.parent is not None:
            if node.lock_ref == 0:
                delta -= len(node.pages)
            node.lock_ref += 1
            node = node.parent
        self.evictable_pages += delta
        self.protected_pages -= delta
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one ``inc_lock_ref(node)``; returns the change in evictable pages (>= 0)."""
        delta = 0
        while node.parent is not None:
            assert node.lock_ref > 0, "unlocking a node that is not locked"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                delta += len(node.pages)
            node = node.parent
        self.evictable_pages += delta
        self.protected_pages -= delta
        return delta

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages of unlocked leaves (LRU first) if there are that many.

        Returns the pages freed; whole leaves go, so it may free a little more.
        """
        heap = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None, "roots are never evicted"
            del parent.children[self._page_key(leaf.key, 0)]
            self._free_pages(leaf.pages)
            if leaf.checkpoint is not None and self._free_checkpoint is not None:
                self._free_checkpoint(leaf.checkpoint)
            freed += len(leaf.pages)
            self.evictable_pages -= len(leaf.pages)
            self.num_evicted_pages += len(leaf.pages)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self._drop_empty_roots()
        return freed

    def drop_lru_checkpoint(
        self, protected: set[int], own: TreeNode | None = None, below: int = 0
    ) -> int | None:
        """Take a checkpoint that is not ``protected`` from its node (the pages stay); None when none
        may go. First the least recently used one no live request holds; else the shallowest on the
        path to ``own`` that ends before ``below`` tokens and no other request holds: the points a
        conversation's earlier turns ended, which its newest turn (resumed at ``below``) supersedes."""
        free = [n for n in self._nodes() if n.checkpoint is not None and n.lock_ref == 0]
        free = [n for n in free if n.checkpoint not in protected]
        if free:
            node = min(free, key=lambda n: n.last_access)
        else:
            path: list[TreeNode] = []
            while own is not None and own.parent is not None:
                path.append(own)
                own = own.parent
            ends = accumulate(len(n.key) for n in reversed(path))
            mine = [n for n, end in zip(reversed(path), ends, strict=True) if end < below and n.lock_ref == 1]
            mine = [n for n in mine if n.checkpoint is not None and n.checkpoint not in protected]
            if not mine:
                return None
            node = mine[0]
        checkpoint, node.checkpoint = node.checkpoint, None
        return checkpoint

    def checkpoints(self) -> list[int]:
        """Every checkpoint the tree holds."""
        return [n.checkpoint for n in self._nodes() if n.checkpoint is not None]

    @staticmethod
    def deepest_checkpoint(node: TreeNode) -> tuple[TreeNode | None, int]:
        """The deepest node on ``node``'s path (itself included) holding a checkpoint, and how many
        tokens end there; (None, 0) for none."""
        while node.parent is not None and node.checkpoint is None:
            node = node.parent
        if node.parent is None:
            return None, 0
        found, depth = node, 0
        while node.parent is not None:
            depth += len(node.key)
            node = node.parent
        return found, depth

    def flush(self) -> int:
        """Evict everything no live request holds; returns the pages freed."""
        return self.evict(self.evictable_pages)

    # ------------------------------------------------------------------ checks

    @property
    def total_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    def check_integrity(self) -> None:
        """Walk the tree and assert every invariant the counters rely on."""
        evictable = protected = 0
        seen: set[int] = set()
        for node in self._nodes():
            assert node.parent is not None
            assert node.key and len(node.key) == len(node.pages) * self.page_size, "edge is not whole pages"
            assert node.parent.children.get(self._page_key(node.key, 0)) is node, "child indexed wrongly"
            pages = set(node.pages)
            assert not seen & pages and len(pages) == len(node.pages), "a page is in the tree twice"
            seen |= pages
            children_locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= children_locks, "a locked child under a less-locked parent"
            if node.lock_ref:
                protected += len(node.pages)
            else:
                evictable += len(node.pages)
        assert (evictable, protected) == (self.evictable_pages, self.protected_pages), (
            f"counters {self.evictable_pages}/{self.protected_pages}, tree {evictable}/{protected}"
        )

    # ------------------------------------------------------------------ helpers

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _drop_empty_roots(self) -> None:
        for namespace in [ns for ns, root in self._roots.items() if not root.children]:
            del self._roots[namespace]

    def _page_key(self, tokens: Sequence[int], pos: int) -> tuple[int, ...]:
        return tuple(tokens[pos : pos + self.page_size])

    def _common_pages(self, child: TreeNode, tokens: Sequence[int], pos: int, end: int) -> int:
        """Whole pages of ``child.key`` equal to ``tokens[pos:end]`` (the first page is known equal)."""
        n = min(len(child.key), end - pos)
        i = self.page_size
        while i < n and child.key[i] == tokens[pos + i]:
            i += 1
        return i // self.page_size

    def _split(self, child: TreeNode, num_pages: int) -> TreeNode:
        """Cut ``child``'s edge after ``num_pages`` pages; returns the new upper node."""
        assert 0 < num_pages < len(child.pages), "split inside the edge only"
        parent = child.parent
        assert parent is not None
        cut = num_pages * self.page_size
        upper = TreeNode(child.key[:cut], child.pages[:num_pages], parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.key, child.pages, child.parent = child.key[cut:], child.pages[num_pages:], upper
        upper.children[self._page_key(child.key, 0)] = child
        parent.children[self._page_key(upper.key, 0)] = upper
        return upper

    def _nodes(self) -> list[TreeNode]:
        """Every non-root node."""
        out: list[TreeNode] = []
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
