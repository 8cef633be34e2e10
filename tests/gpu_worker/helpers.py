"""Test helpers: tiny random HF models on disk, and a pure stand-in for the scheduler.

Every runner in these tests uses ``num_threads=1``: the test machine is small and
shared, and with more OpenMP threads than idle cores torch's thread barriers make
a forward 10-20x slower, not faster.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from gpu_worker.backends.cpu.kind import CpuKind, requested_kind
from protocol.messages import ForwardBatch
from protocol.sampling import WorkerSampling
from tests.models import GREEDY, VOCAB, save_tiny_model  # noqa: F401  (re-exported to the tests here)

# The CPU kinds this CPU (or the kind it acts as) runs: each kernel test runs once per kind.
KINDS = [kind for kind in CpuKind if requested_kind().includes(kind)]


def count_calls(owner: Any, name: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one each time ``owner.name`` is called (the call still runs): which steps
    a one-call decode took."""
    calls: list[int] = []
    original = getattr(owner, name)

    def counted(*args: Any) -> Any:
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(owner, name, counted)
    return calls


@dataclass
class MiniScheduler:
    """Plays the scheduler: hands out pages from a free list and builds ForwardBatch messages."""

    num_pages: int
    page_size: int
    shuffle_seed: int | None = None
    free: list[int] = field(default_factory=list)
    held: dict[int, list[int]] = field(default_factory=dict)
    shared: dict[int, list[int]] = field(
        default_factory=dict
    )  # req_pool_idx -> cached pages to send with its next row
    step: int = 0

    def __post_init__(self) -> None:
        self.free = list(range(self.num_pages))
        if self.shuffle_seed is not None:
            random.Random(self.shuffle_seed).shuffle(self.free)

    def share(self, src_idx: int, dst_idx: int, num_pages: int) -> None:
        """Give ``dst_idx`` the first pages of ``src_idx`` (a cached prefix); sent with its next row."""
        self.held[dst_idx] = []
        self.shared[dst_idx] = self.held[src_idx][:num_pages]

    def batch(self, rows: list[tuple[int, int, list[int], bool, WorkerSampling | None]]) -> ForwardBatch:
        """rows: (req_pool_idx, prefix_len, new token ids, sample, sampler params or None)."""
        fields: dict[str, list[Any]] = {
            k: []
            for k in (
                "req_pool_idx",
                "prefix_lens",
                "extend_lens",
                "input_ids",
                "page_starts",
                "page_counts",
                "pages",
                "sample",
                "sampler",
            )
        }
        for idx, prefix_len, ids, sample, params in rows:
            owned = self.held.setdefault(idx, [])
            start = len(owned)
            owned.extend(self.shared.pop(idx, []))
            need = -(-(prefix_len + len(ids)) // self.page_size) - len(owned)
            owned.extend(self.free.pop(0) for _ in range(max(need, 0)))
            fields["req_pool_idx"].append(idx)
            fields["prefix_lens"].append(prefix_len)
            fields["extend_lens"].append(len(ids))
            fields["input_ids"].extend(ids)
            fields["page_starts"].append(start)
            fields["page_counts"].append(len(owned) - start)
            fields["pages"].extend(owned[start:])
            fields["sample"].append(sample)
            fields["sampler"].append(params)
        self.step += 1
        return ForwardBatch(step=self.step, **fields)
