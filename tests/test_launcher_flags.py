"""Launcher flags whose meaning depends on what the worker reported."""

from __future__ import annotations

import pytest

import launcher
from protocol import WorkerReady


def _ready(device: str) -> WorkerReady:
    return WorkerReady(pid=1, num_pages=64, page_size=16, context_len=2048, device=device, dtype="bfloat16")


@pytest.mark.parametrize(
    ("flags", "device", "mixed"),
    [
        ([], "cpu", True),  # CPU: a prefill pass of its own would stall every running stream
        ([], "cuda:0", False),  # GPU: as SGLang
        (["--no-enable-mixed-chunk"], "cpu", False),
        (["--enable-mixed-chunk"], "cuda:0", True),
    ],
)
def test_mixed_chunk_follows_the_worker_device_unless_set(flags: list[str], device: str, mixed: bool) -> None:
    args = launcher.build_parser().parse_args(flags)
    assert launcher.scheduler_config(args, _ready(device)).enable_mixed_chunk is mixed
