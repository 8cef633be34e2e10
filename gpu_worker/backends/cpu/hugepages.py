"""The interleaved (and 16-bit) weights' memory: one mapping in transparent huge pages.

A one-row decode step streams every weight once, and its tiles run near the memory's pace, so the
page size shows: on 4 KB pages each 4 KB of a 600 MB model costs a TLB miss and a page walk a step.
The weights the backend re-lays at load, and the F16 / BF16 rows it copies as they are (layouts.py's
``in_arena``), are written into one anonymous mapping, 2 MB aligned and madvised ``MADV_HUGEPAGE``,
so the kernel backs it with 2 MB pages where the system's transparent huge pages are ``always`` or
``madvise`` (the common defaults): the tiles read a 1B model's layers faster than on 4 KB pages
(docs/benchmarks-history.md, "Legacy types on 8 bits, weights in huge pages"). Where the call is
missing (not Linux) or refused, the same mapping serves on small pages.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line, as torch's allocator places them


class HugePageArena:
    """``nbytes`` of anonymous memory (zeroed, as the kernel maps it) handed out as uint8 tensors."""

    def __init__(self, nbytes: int) -> None:
        self._map = mmap.mmap(-1, max(nbytes, 1) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge = False
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            try:
                self._map.madvise(advice)
                self.huge = True
            except OSError as exc:
                logger.info("weights on small pages: madvise(MADV_HUGEPAGE) refused (%s)", exc)
        self._all = torch.frombuffer(self._map, dtype=torch.uint8)  # keeps the mapping alive
        self._at = -self._all.data_ptr() % HUGE_PAGE
        self._end = self._at + nbytes

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        """An uninitialised contiguous uint8 tensor of ``shape`` from the arena (ValueError: full)."""
        n = math.prod(shape)
        if self._at + n > self._end:
            raise ValueError(f"arena full: {n} bytes asked, {self._end - self._at} left")
        out = self._all[self._at : self._at + n].view(shape)
        self._at += _aligned(n)
        return out


def arena_bytes(sizes: list[int]) -> int:
    """Bytes an arena needs for tensors of these byte sizes, each placed at ALIGN."""
    return sum(_aligned(n) for n in sizes)


def _aligned(n: int) -> int:
    """n rounded up to a whole number of ALIGN."""
    return -(-n // ALIGN) * ALIGN
