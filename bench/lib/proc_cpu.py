"""CPU time of an engine's processes, sampled from /proc while a benchmark runs (Linux only).

A ``CpuSampler`` thread reads, every ``interval_s``, each named process's utime + stime
(``/proc/PID/stat``, its threads dead or alive) and the run time of each of its threads
(``/proc/PID/task/TID/schedstat``, nanoseconds), so the CPU a process spent inside any window of
the run is read off by interpolation (``cpu_between``). Pure reading: it starts nothing.
"""

from __future__ import annotations

import os
import re
import threading
import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
READY_PIDS = re.compile(r"([\w.]+)=(\d+)")


def ready_line_pids(line: str) -> dict[str, int]:
    """``rivulet ready: ... pids: tokenizer=12 scheduler=13 gpu_worker=14`` -> {name: pid}."""
    _, _, tail = line.partition("pids:")
    return {name: int(pid) for name, pid in READY_PIDS.findall(tail)}


def process_cpu_s(pid: int) -> float | None:
    """utime + stime of ``pid`` (all its threads, those that exited included), or None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) * TICK_S


def thread_cpu_s(pid: int) -> dict[int, float]:
    """tid -> seconds on a CPU, for each live thread of ``pid`` (schedstat: nanosecond resolution)."""
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return out


@dataclass
class Snapshot:
    """One reading: when, each process's CPU seconds, and the threads of the processes asked for."""

    t: float
    process_s: dict[str, float]
    threads_s: dict[str, dict[int, float]] = field(default_factory=dict)


class CpuSampler:
    """Reads the named processes' CPU every ``interval_s`` on a thread of its own until stopped.

    ``threads_of`` names the processes whose threads are read one by one as well (the worker: its
    Python thread against its compute threads). ``self_main_thread`` adds this process's main
    thread as "client" (the benchmark's own requests; not the sampler's reads).
    """

    def __init__(self, pids: dict[str, int], threads_of: Sequence[str] = (), interval_s: float = 0.1) -> None:
        self.pids = dict(pids)
        self.threads_of = tuple(threads_of)
        self.interval_s = interval_s
        self.snapshots: list[Snapshot] = []
        self._main_tid = threading.get_native_id()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def take(self) -> Snapshot:
        procs = {name: s for name, pid in self.pids.items() if (s := process_cpu_s(pid)) is not None}
        own = thread_cpu_s(os.getpid()).get(self._main_tid)
        if own is not None:
            procs["client"] = own
        threads = {name: thread_cpu_s(self.pids[name]) for name in self.threads_of if name in self.pids}
        return Snapshot(time.perf_counter(), procs, threads)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.snapshots.append(self.take())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> CpuSampler:
        self.snapshots.append(self.take())  # before the block, however late the thread first runs
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.snapshots.append(self.take())


def _at(snapshots: Sequence[Snapshot], t: float) -> dict[str, float]:
    """Each counter interpolated linearly at time ``t`` between the two snapshots around it."""
    times = [s.t for s in snapshots]
    i = min(max(bisect_left(times, t), 1), len(snapshots) - 1)
    a, b = snapshots[i - 1], snapshots[i]
    w = 0.0 if b.t <= a.t else min(max((t - a.t) / (b.t - a.t), 0.0), 1.0)
    out = {}
    for name in a.process_s.keys() & b.process_s.keys():
        out[name] = a.process_s[name] + w * (b.process_s[name] - a.process_s[name])
    for proc in a.threads_s.keys() & b.threads_s.keys():
        ta, tb = a.threads_s[proc], b.threads_s[proc]
        for tid in ta.keys() & tb.keys():
            out[f"{proc}/{tid}"] = ta[tid] + w * (tb[tid] - ta[tid])
    return out


def cpu_between(snapshots: Sequence[Snapshot], start: float, end: float) -> dict[str, float]:
    """CPU seconds each process (and ``proc/tid`` thread) spent between ``start`` and ``end``."""
    assert len(snapshots) >= 2, "a window needs two snapshots"
    a, b = _at(snapshots, start), _at(snapshots, end)
    return {name: b[name] - a[name] for name in a.keys() & b.keys()}
