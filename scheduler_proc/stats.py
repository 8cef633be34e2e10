"""The scheduler's INFO log lines, in SGLang's format, kept out of the core's hot paths.

With speculative decoding on, the decode line also gives its window's accept length (tokens per
verify row; "-" when no request drafted), and is followed by the drafts' counts since start, which
are logged once more when the engine goes idle, so a burst shorter than ``decode_log_interval``
decode steps still says how its drafts did.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from scheduler_proc.scheduler import Scheduler
from scheduler_proc.speculative import DraftTotals


class SchedulerStats:
    """One line per prefill (or mixed) batch, and one every ``decode_log_interval`` decode batches."""

    def __init__(
        self,
        decode_log_interval: int,
        logger: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.decode_log_interval = max(decode_log_interval, 1)
        self.logger = logger
        self.clock = clock
        self.num_decode_batches = 0
        self._window_start_s: float | None = None  # None: idle; the next batch opens a window
        self._window_generated = 0
        self.worker_busy_s = self.worker_clock_s = 0.0  # the worker's latest counters
        self._logged_busy_s = self._logged_clock_s = 0.0  # ... as of the previous decode line
        self._rebase_worker = True  # the next worker reply starts the busy window
        self._decode_line_drafts = DraftTotals()  # as of the previous decode line
        self._logged_drafts = DraftTotals()  # as of the previous "Speculative decoding." line

    def on_worker_result(self, busy_s: float, clock_s: float) -> None:
        """Record the worker's busy-seconds counter and clock from a ForwardResult."""
        self.worker_busy_s, self.worker_clock_s = busy_s, clock_s
        if self._rebase_worker:
            self._logged_busy_s, self._logged_clock_s = busy_s, clock_s
            self._rebase_worker = False

    def on_idle(self, sched: Scheduler) -> None:
        """The engine ran dry: idle time must not dilute the next throughput or busy figure; drafts
        verified since the last speculation line are logged."""
        self._window_start_s = None
        self._rebase_worker = True
        if sched.config.speculative and sched.draft_totals != self._logged_drafts:
            self._log_drafts(sched)

    def on_batch(self, sched: Scheduler) -> None:
        """Call right after ``sched.schedule()`` returned a batch."""
        info = sched.last_batch
        assert info is not None, "on_batch called before any batch was scheduled"
        if self._window_start_s is None:
            self._window_start_s = self.clock()
            self._window_generated = sched.num_generated_tokens
        if info.num_prefill_rows:
            self.logger.info(
                "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, cache hit rate: %.1f%%, "
                "token usage: %.2f, #running-req: %d, #queue-req: %d",
                info.num_prefill_rows,
                info.num_prefill_tokens,
                info.num_cached_tokens,
                100 * sched.cache_hit_rate,
                sched.kv.usage,
                info.num_decoding,
                len(sched.waiting),
            )
            return
        self.num_decode_batches += 1
        if self.num_decode_batches % self.decode_log_interval == 0:
            self._log_decode(sched, info.num_decode_rows)

    def _log_decode(self, sched: Scheduler, num_decode_rows: int) -> None:
        speculative = sched.config.speculative
        self.logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
            "gen throughput (token/s): %.2f, worker busy: %.1f%%, #queue-req: %d%s",
            num_decode_rows,
            sched.kv.used_tokens,
            sched.kv.usage,
            self._throughput(sched),
            100 * self._worker_busy_share(),
            len(sched.waiting),
            self._accept_length_since_last_line(sched) if speculative else "",
        )
        if speculative:
            self._log_drafts(sched)

    def _accept_length_since_last_line(self, sched: Scheduler) -> str:
        totals = sched.draft_totals
        window, self._decode_line_drafts = totals - self._decode_line_drafts, totals
        return f", accept len: {window.accept_length:.2f}" if window.verify_rows else ", accept len: -"

    def _log_drafts(self, sched: Scheduler) -> None:
        """Speculative decoding's counts since start (bench/speculative.py reads the latest)."""
        totals = self._logged_drafts = sched.draft_totals
        self.logger.info(
            "Speculative decoding. #drafted-token: %d, #accepted-token: %d, #verify-row: %d, "
            "accept rate: %.1f%%, accept len: %.2f",
            totals.drafted,
            totals.accepted,
            totals.verify_rows,
            100 * totals.acceptance_rate,
            totals.accept_length,
        )

    def _worker_busy_share(self) -> float:
        """The worker's busy share since the previous decode line, from its own timestamps."""
        busy = self.worker_busy_s - self._logged_busy_s
        elapsed = self.worker_clock_s - self._logged_clock_s
        self._logged_busy_s, self._logged_clock_s = self.worker_busy_s, self.worker_clock_s
        return busy / elapsed if elapsed > 0 else 0.0

    def _throughput(self, sched: Scheduler) -> float:
        """Tokens sampled per second since the previous decode line (or since the engine woke up)."""
        now = self.clock()
        assert self._window_start_s is not None, "a window opens with every batch"
        tokens = sched.num_generated_tokens - self._window_generated
        elapsed_s = now - self._window_start_s
        self._window_start_s, self._window_generated = now, sched.num_generated_tokens
        return tokens / elapsed_s if elapsed_s > 0 else 0.0
