"""A development aid: ``RIVULET_STEP_TRACE=DIR`` has the scheduler and the worker write one JSON line
per event to ``DIR/NAME-PID.jsonl``: the scheduler each request it queues and each batch it sends or
gets back, the worker each step (when its frame came, when the forward began and ended, its rows,
tokens and thread count, and the CPU its thread spent). Times are ``time.monotonic()``, one clock
for every process of the machine, so the files line up into one timeline (``bench.step_timeline``
reads them).

Off (no file, one ``None`` check an event) unless the variable is set. Lines are written as they
come, so an engine stopped by a signal leaves every event before it.
"""

from __future__ import annotations

import json
import os
from typing import IO

TRACE_DIR_ENV = "RIVULET_STEP_TRACE"


class StepTrace:
    """Appends one JSON object a line; ``open`` gives None when tracing is off."""

    def __init__(self, file: IO[str]) -> None:
        self._file = file

    @classmethod
    def open(cls, name: str) -> StepTrace | None:
        out_dir = os.environ.get(TRACE_DIR_ENV)
        if not out_dir:
            return None
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"{name}-{os.getpid()}.jsonl")
        return cls(open(path, "a", buffering=1, encoding="utf-8"))  # noqa: SIM115 (open while the process lives)

    def write(self, event: str, **fields: object) -> None:
        self._file.write(json.dumps({"event": event, **fields}) + "\n")


def run_delay_s() -> float | None:
    """Seconds the calling thread has waited on a run queue for a core (Linux schedstat), None
    where the kernel does not tell."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None
