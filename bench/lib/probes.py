"""What bench/targets.py reads besides tokens: the engine's /metrics, the worker's busy share,
and the CPU time of a process tree (from /proc). Pure helpers, no engine."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

from bench.lib import launch
from bench.lib.metrics import RequestResult

BUSY_COUNTER, BUSY_CLOCK = "rivulet_worker_busy_seconds_total", "rivulet_worker_clock_seconds"
STATS_LAG_S = 0.5  # the scheduler sends the worker's counters at most this often (STATS_INTERVAL_S)
Sample = tuple[float, dict[str, float]]  # (arrival time, parsed GET /metrics)


def parse_prometheus(text: str) -> dict[str, float]:
    """The unlabelled samples of a Prometheus text exposition, as name -> value."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#") and "{" not in parts[0]:
            with contextlib.suppress(ValueError):
                out[parts[0]] = float(parts[1])
    return out


def steady_window_s(results: Sequence[RequestResult], streams: int) -> tuple[float, float] | None:
    """From the moment ``streams`` requests have their first token to the first finish: all decoding."""
    firsts = sorted(r.token_times_s[0] for r in results if r.token_times_s)
    finishes = [r.finish_s for r in results if r.finish_s is not None]
    if len(firsts) < streams or not finishes:
        return None
    return firsts[streams - 1], min(finishes)


def busy_share(
    samples: Sequence[tuple[float, dict[str, float]]], window: tuple[float, float]
) -> float | None:
    """d busy / d clock between the first and last worker report seen inside ``window``.

    ``samples`` are (arrival time, parsed /metrics). A report can be up to STATS_LAG_S old
    when it arrives, so samples from the window's first STATS_LAG_S are left out.
    """
    start, end = window[0] + STATS_LAG_S, window[1]
    reports = sorted(
        {(m[BUSY_CLOCK], m[BUSY_COUNTER]) for t, m in samples if start <= t <= end and BUSY_CLOCK in m}
    )
    if len(reports) < 2 or reports[-1][0] <= reports[0][0]:
        return None
    return (reports[-1][1] - reports[0][1]) / (reports[-1][0] - reports[0][0])


def cpu_ticks(pid: int) -> tuple[int, int] | None:
    """(start time, utime + stime) of ``pid`` in clock ticks, from /proc; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19]), int(fields[11]) + int(fields[12])


def tree_cpu_ticks(root: int) -> dict[int, tuple[int, int]]:
    """pid -> (start, CPU ticks) for ``root`` and every descendant."""
    pids = [root, *launch.descendants(root)]
    return {pid: t for pid in pids if (t := cpu_ticks(pid)) is not None}


def cpu_percent(
    before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], wall_s: float
) -> float:
    """CPU the tree used between two snapshots, as % of one core; a process started since counts whole."""
    used = 0
    for pid, (start, ticks) in after.items():
        prev = before.get(pid)
        used += ticks - prev[1] if prev is not None and prev[0] == start else ticks
    return 100.0 * used / os.sysconf("SC_CLK_TCK") / wall_s
