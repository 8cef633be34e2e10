"""Keep the worker's freed memory for its next step (glibc's malloc).

A step allocates the same large buffers every time: activations, logits, the C kernels' arenas (a
mixture of experts' block gathers ~30 KB per (token, expert) pair: 64 MB for a 256-token chunk of a
top-8 model). glibc serves a block above its mmap threshold (at most 32 MB, adjusted as blocks are
freed) with a fresh mapping and gives it back on free, and trims the heap's free top above its trim
threshold, so each step faults those pages in again, many times the cost of reusing the heap
(docs/benchmarks-history.md, "Numbers behind the code's choices"). After the model is loaded (its own
transient copies are given back as they were), the worker raises both thresholds: blocks up to
1 GB come from the heap, and the heap keeps what a step frees for the next one. The worker's
resident memory then holds the largest step's working set on top of the weights and the KV pool.
"""

from __future__ import annotations

import ctypes
import logging

from protocol.transport import libc_function

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1  # an int: the largest

_done = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds in this process (once); False where there is no
    glibc (musl, macOS) or it refuses."""
    global _done
    if _done:
        return True
    mallopt = libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if _done:
        logger.info("malloc keeps freed memory for the next step (mmap threshold 1 GB, no trim)")
    return _done
