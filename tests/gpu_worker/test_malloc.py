"""backends/cpu/malloc.py: after keep_freed_memory a step's large freed block stays in the heap for
the next step, where glibc's defaults hand it back (to fault its pages in again)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc tunables")

PROBE = """
import ctypes
from gpu_worker.backends.cpu.malloc import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def kept(size=64 << 20):
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    return libc.mallinfo2().fordblks >= size  # the heap's free bytes hold it

before = kept()
print(before, keep_freed_memory(), kept())
"""


def test_a_freed_64_mb_block_stays_in_the_heap() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["False", "True", "True"], out.stdout + out.stderr


TRIM_PROBE = """
import ctypes
from pathlib import Path
from gpu_worker.backends.cpu.malloc import keep_freed_memory
from protocol.transport import trim_heap

def rss_mb():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
    return int(line.split()[1]) // 1024

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
keep_freed_memory()
block = libc.malloc(64 << 20)
ctypes.memset(block, 1, 64 << 20)
libc.free(block)  # kept in the heap, its pages resident
kept = rss_mb()
trim_heap()
print(kept - rss_mb())
"""


def test_trim_heap_gives_the_kept_pages_back() -> None:
    """What the worker keeps for its steps stays resident until trim_heap, which the worker calls once
    loading is done (before the KV pool) and as it announces itself ready."""
    out = subprocess.run(
        [sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    assert int(out.stdout) >= 60, out.stdout + out.stderr
